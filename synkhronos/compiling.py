"""Where and how PyTensor compiles synkhronos' graphs.

PyTensor writes the Python source of every graph it compiles to a file; with its
``generated_src_dir`` unset, to a new temporary file per graph that it never removes
(every worker, every run).  Synkhronos uses a content-addressed directory in PyTensor's
compiledir instead, which PyTensor reuses across runs and prunes; a directory the user
chose is kept."""
import contextlib


def generated_src_dir():
    """The directory PyTensor keeps the generated source of synkhronos' graphs in."""
    import os

    import pytensor
    return pytensor.config.generated_src_dir or os.path.join(pytensor.config.compiledir, "generated_src")


@contextlib.contextmanager
def compiling():
    """Compile in here (master side): the user's PyTensor settings are back afterwards."""
    import pytensor
    cfg = pytensor.config
    saved = cfg.generated_src_dir
    cfg.generated_src_dir = generated_src_dir()
    try:
        yield
    finally:
        cfg.generated_src_dir = saved
