"""Thread settings the peer's CLIs apply before torch is imported (OpenMP/MKL read them then)."""
import os


def pin_threads(threads):
    """Use `threads` CPU threads in every math library torch may load."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
