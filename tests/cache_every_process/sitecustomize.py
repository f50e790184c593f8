"""Lets every process of a multi-process test run write jax's persistent compilation cache.

jax writes cache entries from process 0 only, expecting the processes of a run to share one key
per program. XLA:CPU's key includes each process's own topology, so on this CPU process 1 never
finds its programs in the cache and compiles its train step afresh at every start (about 4 s of
each 2-process test, process 0 waiting meanwhile in the first collective). The keys differ, so no
two processes write one entry. Test worker processes import this through ``PYTHONPATH``
(``helpers.multiprocess_env``); it changes no program, only where a compiled one is kept.
"""

import functools

try:
    from jax._src import compiler, distributed
except ImportError:  # another jax layout: the workers compile as users' processes do
    compiler = None
_write = getattr(compiler, "_cache_write", None)
if _write is not None:

    @functools.wraps(_write)
    def _cache_write(*args, **kwargs):
        process_id = distributed.global_state.process_id
        distributed.global_state.process_id = 0  # read only by the compile paths
        try:
            return _write(*args, **kwargs)
        finally:
            distributed.global_state.process_id = process_id

    compiler._cache_write = _cache_write
