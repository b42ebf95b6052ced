"""`python -m tests.support.crashing_gateway <serving.gateway flags>`: the gateway, except that running a job whose
request_id starts with "crash-" kills the process at once (exit 70): a request that crashes the gateway, injected, for
the jobs' crash cap (tests/serving/gateway/test_gateway_jobs.py)."""
import os
import runpy

import serving.gateway.app as _app

CRASH_EXIT_CODE = 70
_job_stream = _app.Gateway._job_stream


def _crashing_job_stream(self, request, tenant_name):
    if request.request_id.startswith("crash-"):
        os._exit(CRASH_EXIT_CODE)
    return _job_stream(self, request, tenant_name)


_app.Gateway._job_stream = _crashing_job_stream

if __name__ == "__main__":
    runpy.run_module("serving.gateway", run_name="__main__", alter_sys=True)
