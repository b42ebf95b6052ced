"""`python -m tests.support.gateway_instance <serving.server flags>`: an instance server whose debug step delay is re-read
from the file named by $MESHSERVE_DEBUG_STEP_DELAY_FILE every 0.1 s, so gateway tests can slow an instance down
and back at run time without a server flag for it. Test-only too: $MESHSERVE_DEBUG_PULL_CHUNK_DELAY_S (seconds) makes
a --role=prefill instance wait that long before each PullKV chunk it sends, a deterministic window in which a fault
test kills an instance mid-transfer (tests/serving/gateway/test_disaggregation_faults.py)."""
import os
import runpy
import threading
import time

_PATH = os.environ.get("MESHSERVE_DEBUG_STEP_DELAY_FILE", "")
_PULL_DELAY_S = float(os.environ.get("MESHSERVE_DEBUG_PULL_CHUNK_DELAY_S", "0") or 0)

if _PULL_DELAY_S > 0:
    import asyncio

    import serving.server.disagg as _disagg

    _orig_pull_kv = _disagg.Disaggregation.pull_kv

    async def _slow_pull_kv(self, request, context):
        async for msg in _orig_pull_kv(self, request, context):
            await asyncio.sleep(_PULL_DELAY_S)  # before each chunk leaves: the decode side is mid-pull meanwhile
            yield msg

    _disagg.Disaggregation.pull_kv = _slow_pull_kv

if _PATH:
    import serving.server.app as _app

    _orig_init = _app.InstanceServer.__init__

    def _init(self, engine, config, **kw):
        _orig_init(self, engine, config, **kw)

        def poll():  # the engine reads config.debug_step_delay_s at every step
            while True:
                try:
                    with open(_PATH) as f:
                        engine.config.debug_step_delay_s = float(f.read().strip() or 0.0)
                except (OSError, ValueError):
                    pass
                time.sleep(0.1)
        threading.Thread(target=poll, daemon=True, name="debug-step-delay").start()

    _app.InstanceServer.__init__ = _init

runpy.run_module("serving.server", run_name="__main__", alter_sys=True)
