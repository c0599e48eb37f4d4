"""The tables and the figure of ``bench_mpi.py``: each prints one table of its measurements
and returns the figures it shows, for ``mpi.json``."""
import os

import numpy as np

from common import pyplot

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30


def fmt_size(s):
    return f"{s // GB} GB" if s >= GB else f"{s // MB} MB" if s >= MB else f"{s // KB} KB"


def fmt_t(t):
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def fmt_r(x):
    return f"{x:.2f}" if x >= 0.095 else f"{x:.3f}"


def med(ts):
    return float(np.median(ts)) if len(ts) else float("nan")


def allreduce_table(sizes, placements, raw, per_round, checks_ok, per_host):
    """1. ``all_reduce``: synkhronos against mpi4py (bare and master-driven), per placement."""
    n = 2 * per_host
    f = 2 * (n - 1) / n
    ar = {pl: {} for pl in placements}
    print(f"\n1. all_reduce (float32, sum), 2 hosts x {per_host} rank(s): median time, algbw / busbw [GB/s]; "
          "ratio = synk time / mpi4py time (<1: synk faster), per-round ratios in brackets; "
          "driven: mpi4py master-driven (see below), ratio = synk / driven")
    for pl in placements:
        print(f"\n  placement '{pl}'" + (" (kernel's choice)" if pl == "default" else
                                         " (each host's MPI leader on its own core)"))
        hdr = (f"  {'size':>7} | {'synk':>10} {'alg':>6} {'bus':>6} | {'mpi4py':>10} {'alg':>6} "
               f"{'bus':>6} | {'ratio':>6}  per round | {'driven':>9} {'ratio':>6}")
        print(hdr)
        print("  " + "-" * (len(hdr) - 2))
        for s in sizes:
            xs, xm, xd = raw[("synk", pl)][s], raw[("mpi4py", pl)][s], raw[("mpi4py_driven", pl)][s]
            ts, tm, td = med(xs), med(xm), med(xd)
            rr = [q / m for q, m in zip(per_round[("synk", pl)][s], per_round[("mpi4py", pl)][s])]
            a_s, a_m = s / ts / 1e9, s / tm / 1e9
            ar[pl][s] = dict(synk_s=ts, mpi4py_s=tm, ratio=ts / tm, ratio_per_round=rr,
                             synk_algbw_GBps=a_s, synk_busbw_GBps=a_s * f, mpi4py_algbw_GBps=a_m,
                             mpi4py_busbw_GBps=a_m * f, synk_times=xs, mpi4py_times=xm,
                             driven_s=td, ratio_driven=ts / td, driven_times=xd)
            print(f"  {fmt_size(s):>7} | {fmt_t(ts):>10} {a_s:6.3f} {a_s * f:6.3f} | {fmt_t(tm):>10} "
                  f"{a_m:6.3f} {a_m * f:6.3f} | {fmt_r(ts / tm):>6}  [{' '.join(fmt_r(x) for x in rr)}] | "
                  f"{fmt_t(td):>9} {fmt_r(ts / td):>6}")
        worst = max(sizes, key=lambda s: ar[pl][s]["ratio"])
        met = ar[pl][worst]["ratio"] <= 1.5
        print(f"  goal (synk within 1.5x of mpi4py at every size): {'MET' if met else 'NOT MET'} "
              f"(worst {fmt_size(worst)}: {ar[pl][worst]['ratio']:.2f}x)")
        floor = max(sizes, key=lambda s: ar[pl][s]["driven_s"] / ar[pl][s]["mpi4py_s"])
        print(f"  driven: mpi4py as a master-driven program (rank 0 sends the command, all Allreduce, "
              f"rank 0 hears every rank done) -- the least any design where one process decides needs; "
              f"it alone is {ar[pl][floor]['driven_s'] / ar[pl][floor]['mpi4py_s']:.2f}x the Allreduce "
              f"at {fmt_size(floor)}")
    print(f"  results checked (exact value after the last call, every rank, first and last element): "
          f"{'ok' if checks_ok else 'WRONG RESULTS (see above)'}")
    return ar


def overhead_table(ovh, placements, per_host):
    """2. The per-call time of a tiny function: one host, one host with as many ranks as the
    two-host job has processes, two hosts (per placement)."""
    ov = {}
    print("\n2. per-call time of a tiny function (sum of an 8-element float32 synk.data): median of "
          "blocks [us]")
    pt_all = [t * 1e6 for rs in ovh.values() for r in rs for t in r["pytensor"]]
    ov["pytensor_us"] = med(pt_all)
    print(f"  {'plain PyTensor call':44s} {ov['pytensor_us']:9.2f}")
    labels = {"one_host": "synk, 1 host x 2 ranks (no MPI)",
              "one_host_procs": f"synk, 1 host x {2 * per_host + 1} ranks (no MPI)"}
    labels.update({f"two_hosts_{pl}": f"synk, 2 hosts x {per_host} rank(s) (mpiexec), {pl}" for pl in placements})
    for where in ["one_host", "one_host_procs"] + [f"two_hosts_{pl}" for pl in placements]:
        rs = ovh[where]
        if not rs:
            continue
        s_all = [t * 1e6 for r in rs for t in r["synk"]]
        ov[where] = dict(synk_us=med(s_all), synk_blocks_us=s_all,
                         per_round_us=[med(r["synk"]) * 1e6 for r in rs],
                         pytensor_us=med([t * 1e6 for r in rs for t in r["pytensor"]]),
                         ok=all(r["ok"] for r in rs), n=rs[0]["n"])
        extra = ""
        if where.startswith("two_hosts") and "one_host" in ov:
            extra = f"; {ov[where]['synk_us'] / ov['one_host']['synk_us']:.1f}x one host"
            if "one_host_procs" in ov:
                extra += f", {ov[where]['synk_us'] / ov['one_host_procs']['synk_us']:.1f}x {2 * per_host + 1} ranks"
        print(f"  {labels[where]:44s} {ov[where]['synk_us']:9.1f}   (+{ov[where]['synk_us'] - ov['pytensor_us']:.1f} "
              f"over PyTensor{extra})   per round "
              f"{' '.join(f'{x:.1f}' for x in ov[where]['per_round_us'])}")
    for pl in placements:
        if f"two_hosts_{pl}" in ov and "one_host" in ov:
            x = ov[f"two_hosts_{pl}"]["synk_us"] / ov["one_host"]["synk_us"]
            print(f"  goal (a call over 2 hosts <= 3x the call on one host), {pl}: "
                  f"{'MET' if x <= 3 else 'NOT MET'} ({x:.1f}x)")
    if "one_host_procs" in ov:
        print(f"  ({2 * per_host + 1} ranks on one host: as many processes as the 2-host job, whose host "
              f"without the master runs an MPI process beside its rank(s); on {len(os.sched_getaffinity(0))} "
              f"cores that many processes take turns, which the 2-rank call does not)")
    return ov


def demo_table(demos, rounds, per_host, demo_args):
    """3. The demo's milestones on two hosts against one."""
    dm = {}
    print(f"\n3. demos/mnist_mlp.py {' '.join(demo_args)}; numba cache warm (one untimed run "
          f"of each first); seconds since the process started, median of {rounds} run(s), "
          f"kernel's placement")
    keys = [("t_fork", "synk.fork() done"), ("t_distributed", "synk.distribute() done"),
            ("t_first_step", "first synk step (+ first evaluate) done"),
            ("t_serial_done", "demo's serial runs done (in turns with synk's)"),
            ("wall_s", "process exit"), ("distribute_s", "demo: distribute() took"),
            ("jit_synk_s", "demo: synk first call (excluded)"),
            ("jit_serial_s", "demo: serial first call (excluded)"),
            ("graph_build_s", "demo: graph build"), ("epoch_s", "demo: synk epoch (3 steps)")]
    print(f"  {'':44s} {f'2 hosts ({2 * per_host} ranks)':>18s} {'1 host (2 ranks)':>17s}")
    for k, label in keys:
        v2 = med([d[k] for d in demos["two_hosts"] if k in d])
        v1 = med([d[k] for d in demos["one_host"] if k in d])
        dm[k] = {"two_hosts": v2, "one_host": v1}
        print(f"  {label:44s} {v2:18.2f} {v1:17.2f}")
    dm["runs"] = demos
    for where in ("two_hosts", "one_host"):
        for d in demos[where][:1]:
            print(f"  {where} (round 1): {d.get('result_line', '(no RESULT line)')[:200]}")
    return dm


def plot(sizes, ar, ov, path, per_host):
    plt = pyplot("matplotlib not installed: no figure")
    if plt is None:
        return
    x = np.array(sizes)
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    styles = {"default": "-", "pinned": "--"}
    for pl, d in ar.items():
        for impl, mark, color in (("synk", "o", "C0"), ("mpi4py", "^", "C1")):
            name = "synkhronos" if impl == "synk" else "mpi4py Allreduce"
            ax[0].loglog(x, [d[s][f"{impl}_s"] * 1e3 for s in sizes], styles[pl] + mark,
                         color=color, label=f"{name} ({pl})")
            if impl == "mpi4py":
                ax[0].loglog(x, [d[s]["driven_s"] * 1e3 for s in sizes], styles[pl] + "v", color="C5",
                             label=f"mpi4py master-driven ({pl})")
            ax[1].loglog(x, [d[s][f"{impl}_busbw_GBps"] for s in sizes], styles[pl] + mark,
                         color=color, label=f"{name} ({pl})")
        ax[2].semilogx(x, [d[s]["ratio"] for s in sizes], styles[pl] + "o",
                       color="C2" if pl == "default" else "C4", label=f"synk / mpi4py ({pl})")
        ax[2].semilogx(x, [d[s]["driven_s"] / d[s]["mpi4py_s"] for s in sizes], styles[pl] + "v",
                       color="C5", label=f"master-driven mpi4py / mpi4py ({pl})")
        for s in sizes:
            rr = d[s]["ratio_per_round"]
            ax[2].plot([s] * len(rr), rr, "x", color="0.6")
    ax[0].set_ylabel("time [ms]")
    ax[0].set_title(f"all_reduce float32 sum, 2 hosts x {per_host} rank(s)")
    ax[1].set_ylabel("busbw [GB/s]")
    ax[1].set_title("bus bandwidth = bytes/time x 2(n-1)/n")
    ax[2].axhline(1.0, color="0.3", lw=0.8)
    ax[2].axhline(1.5, color="C3", ls=":", lw=1, label="goal: <= 1.5")
    ax[2].set_yscale("log")
    ax[2].set_ylabel("time ratio (<1: synk faster); x: per round")
    ax[2].set_title("synkhronos time / mpi4py time")
    from matplotlib.ticker import FuncFormatter, NullFormatter
    ax[2].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax[2].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    for a in ax:
        a.set_xticks(sizes, [fmt_size(s) for s in sizes], fontsize=8)
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_xlabel("buffer size")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    parts = [f"PyTensor {ov['pytensor_us']:.1f} us"]
    if "one_host" in ov:
        parts.append(f"synk 1 host {ov['one_host']['synk_us']:.0f} us")
    if "one_host_procs" in ov:
        parts.append(f"1 host x {ov['one_host_procs']['n']} ranks {ov['one_host_procs']['synk_us']:.0f} us")
    parts += [f"synk 2 hosts ({k[10:]}) {v['synk_us']:.0f} us" for k, v in ov.items()
              if k.startswith("two_hosts_")]
    fig.suptitle("per-call time, tiny function: " + ", ".join(parts), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(path)
