"""`single_threaded_numpy_blas`: NumPy's BLAS on one thread (the offload policies' inline products)."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from elasticmoe.utils.numpy_blas import single_threaded_numpy_blas


def blas_threads() -> list[int]:
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


def test_numpy_blas_runs_on_one_thread_once_limited():
    np.ones((2, 2)) @ np.ones((2, 2))  # NumPy's BLAS is loaded
    with threadpool_limits(limits=2, user_api="blas"):  # as on a two-core machine; restored on exit
        assert blas_threads() and all(n == 2 for n in blas_threads())
        assert single_threaded_numpy_blas() == len(blas_threads())
        assert all(n == 1 for n in blas_threads())
        assert single_threaded_numpy_blas() == len(blas_threads())  # again: nothing left to do
