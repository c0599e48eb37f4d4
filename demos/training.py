"""The training a demo runs, built in the master before ``synk.distribute()``: the model's
softmax cross-entropy, its data-parallel training step (``synkhronos.extensions.train``)
and an evaluation function (correct counts and summed losses over the ranks, ``num_slices``
pieces per rank); then what the harness does with them: a serial step (plain PyTensor in
the master through the same compiled graphs, ``step.serial``), a data-parallel step,
evaluation, and going back to the initial parameters.

Data patterns (``--data-pattern``): ``batch`` keeps the training set in a ``synk.Data``
and passes a shuffled index array every step (``batch=idx``, each rank gathers its rows);
``scatter`` scatters it once into shared variables declared in ``sliceable_shareds``, one
shard per rank, and selects rows of each shard with ``batch_s``."""
import numpy as np

import synkhronos as synk

from losses import picked
from report import plural


def values(variables):
    """Copies of the master's values of shared ``variables``."""
    return [np.array(v.get_value(), copy=True) for v in variables]


def n_params(model):
    """How many numbers the model's trainable parameters hold."""
    return int(sum(p.get_value(borrow=True).size for p in model.params))


class Training:
    """``model``, its training function ``step`` and evaluation function ``f_eval`` on
    ``data`` (``digits.load``'s dict) at ``B`` rows per step over ``n`` ranks; prints the
    model and the training settings."""

    def __init__(self, args, build_model, data, B, n, dtype):
        import pytensor
        import pytensor.tensor as pt

        from synkhronos.extensions import train, updates

        self.X_tr, self.y_tr = data["train"]
        self.pattern, self.eval_slices = args.data_pattern, args.eval_slices
        h, w = data["shape"]
        lr = args.learning_rate
        x = pt.matrix("x", dtype=dtype)
        y = pt.ivector("y")
        model = self.model = build_model(x, h, w)
        self.stats = list(getattr(model, "stats", []))
        stat_updates = list(getattr(model, "stat_updates", []))
        eval_logits = getattr(model, "eval_logits", None)
        logp = pt.special.log_softmax(model.logits, axis=-1)
        classes = int(self.y_tr.max()) + 1
        loss = pt.mean(-picked(logp, y, classes))
        logp_eval = logp if eval_logits is None else pt.special.log_softmax(eval_logits, axis=-1)
        nll_eval = -picked(logp_eval, y, classes)
        n_correct = pt.sum(pt.eq(pt.argmax(logp_eval, axis=-1), y))     # int64
        print(f"model: {model.description}; {n_params(model)} parameters, {dtype}")
        sharded = ", state sharded over the ranks" if args.shard_updates else ""
        print(f"training: {args.rule} lr={lr:g}{sharded}, batch {B} ({B // n} per rank), "
              f"{plural(args.epochs, 'epoch')}, data pattern '{args.data_pattern}'")

        base_rule = getattr(updates, args.rule)

        def rule(loss_, params_, **kw):
            # batch-norm running statistics: updated by the gradient function, in every rank,
            # from that rank's share of the batch (not synchronized; see sync_stats)
            g_upd, p_upd, g_shared = base_rule(loss_, params_, **kw)
            return list(g_upd) + stat_updates, p_upd, g_shared

        if self.pattern == "batch":
            self.step = train.make_train_function(loss, model.params, [x, y], rule,
                                                  learning_rate=lr, shard_updates=args.shard_updates)
        else:
            self.X_s = pytensor.shared(np.zeros((0, self.X_tr.shape[1]), dtype), name="X_train_s")
            self.y_s = pytensor.shared(np.zeros(0, np.int32), name="y_train_s")
            self.step = train.make_train_function(loss, model.params, [], rule, learning_rate=lr,
                                                  givens=[(x, self.X_s), (y, self.y_s)],
                                                  sliceable_shareds=[self.X_s, self.y_s],
                                                  shard_updates=args.shard_updates)
        # sums, not averages: an int output with mode "avg" would be rounded
        self.f_eval = synk.function([x, y], outputs=[(n_correct, "sum"), (pt.sum(nll_eval), "sum")],
                                    name="evaluate")

    def serial_step(self, idx):
        """One step on the training rows ``idx`` in the master alone: plain PyTensor, the
        same compiled graphs."""
        if self.pattern == "batch":
            return self.step.serial(self.X_tr[idx], self.y_tr[idx])
        self.X_s.set_value(self.X_tr[idx], borrow=True)   # the scatter graph reads the
        self.y_s.set_value(self.y_tr[idx], borrow=True)   # (master's) shareds
        return self.step.serial()

    # ---- after synk.distribute() ----------------------------------------------------------

    def state(self):
        """The training's state now, for :meth:`restore`: the step's (``step.snapshot``:
        parameters, gradient, the rule's state) and the running statistics, as the master
        holds them (every rank's, once :meth:`evaluate` averaged the statistics)."""
        return self.step.snapshot(), values(self.stats)

    def remember_initial(self):
        """Keep the initial state for :meth:`restore`."""
        self.initial = self.state()

    def restore(self, state=None):
        """The master and every rank to ``state`` (from :meth:`state`; default: the initial
        one), through ``synk.broadcast``: all equal."""
        values, stats = self.initial if state is None else state
        self.step.restore(values)
        if self.stats:
            synk.broadcast(self.stats, [v.copy() for v in stats])

    def serial_state(self):
        """What the serial step reads and writes, in the master only (no collective): the
        step's (``step.serial_snapshot``), the running statistics and, with the ``scatter``
        pattern, the master's shard of the training set (the serial step sets it to its
        rows).  To take turns between serial runs and the data-parallel one."""
        shards = [v.get_value(borrow=True) for v in (self.X_s, self.y_s)] if self.pattern != "batch" else []
        return self.step.serial_snapshot(), values(self.stats), shards

    def set_serial_state(self, state):
        """Back to ``state`` (from :meth:`serial_state`), in the master only."""
        values, stats, shards = state
        self.step.serial_restore(values)
        for v, val in zip(self.stats, stats):
            v.set_value(val.copy())
        for v, val in zip((self.X_s, self.y_s) if shards else (), shards):
            v.set_value(val, borrow=True)

    def params_now(self):
        return values(self.model.params)

    def feed_ranks(self, lengths):
        """The data-parallel step, ``synk_step(sel)`` (``sel``: a step of
        ``batches.plan_batches``), once the ranks have the training set: a ``synk.Data``
        (``batch``) or their shards (``scatter``, of ``lengths`` rows)."""
        if self.pattern == "batch":
            X_tr_d, y_tr_d = synk.data(self.X_tr), synk.data(self.y_tr)

            def synk_step(sel):
                return self.step(X_tr_d, y_tr_d, batch=sel[0])
        else:
            synk.scatter([self.X_s, self.y_s], [self.X_tr, self.y_tr])
            assert synk.get_lengths(self.X_s) == lengths

            def synk_step(sel):
                return self.step(batch_s=sel)
        return synk_step

    def sync_stats(self):
        """One all-reduce: every rank's running statistics become their average over ranks."""
        if self.stats:
            synk.all_reduce(self.stats, op="avg")

    def evaluate(self, Xd, yd):
        """(accuracy, mean loss) on the ``synk.Data`` ``Xd``, ``yd``, by the ranks."""
        self.sync_stats()
        c, s = self.f_eval(Xd, yd, num_slices=self.eval_slices)
        return float(c) / len(yd), float(s) / len(yd)
