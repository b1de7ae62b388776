"""NumPy's BLAS on one thread, in processes whose NumPy products run inline on the forward thread.

NumPy's bundled OpenBLAS starts as many threads as the machine has cores and, after a product,
keeps them spinning for a while in case another one follows. The expert-offloading policies run
their small products (FineMoE's semantic search, [B, h] x [h, C], and the map store's redundancy
products) on the forward thread between PyTorch ops. On two cores, OpenBLAS's second thread then
spins on the core the expert copier prefetches on: at 16 requests in flight and half the experts
cached, FineMoE's hit rate fell from 0.94 to 0.88 and its TPOT rose from 1.49-1.53x to 1.81-1.93x of
resident (docs/offload.md, "NumPy's BLAS threads"). One thread also makes those products faster
here (a [64, 512] x [512, 1,000] product: 1.1 ms against 3.7 ms on two threads).
"""

from __future__ import annotations

import logging

from threadpoolctl import threadpool_info, threadpool_limits

logger = logging.getLogger(__name__)


def single_threaded_numpy_blas() -> int:
    """Limit the BLAS libraries loaded in this process (NumPy's OpenBLAS; PyTorch's GEMMs run on
    oneDNN and its own threads, which this leaves alone) to one thread from now on. Returns how
    many libraries it limited."""
    libraries = [info for info in threadpool_info() if info["user_api"] == "blas"]
    if any(info["num_threads"] > 1 for info in libraries):
        threadpool_limits(limits=1, user_api="blas")
        logger.info("NumPy's BLAS (%s) limited to one thread: its products run inline on the forward thread",
                    ", ".join(info["internal_api"] for info in libraries))
    return len(libraries)
