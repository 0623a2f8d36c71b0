"""run_service as a real process: the first signal stops it, within its grace period."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
import time

_HANGS_ON_STOP = textwrap.dedent(
    """
    import asyncio, sys
    from conveyor_runtime.service import run_service
    from conveyor_runtime.settings import CommonSettings

    async def main(settings, stop):
        print("ready", flush=True)
        await stop.wait()
        await asyncio.sleep(3600)  # a stop that never finishes on its own

    settings = CommonSettings(broker="memory", stop_grace=float(sys.argv[1]))
    sys.exit(run_service(main, settings, name="hangs"))
    """
)


async def _spawn(grace: float) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HANGS_ON_STOP,
        str(grace),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    # The service's own log lines come first.
    while (line := await asyncio.wait_for(proc.stdout.readline(), 30)).strip() != b"ready":
        assert line, "the process ended before it was ready"
    return proc


async def test_a_stop_past_the_grace_period_is_cut_short() -> None:
    proc = await _spawn(grace=0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 1
    assert time.monotonic() - started < 10
    assert proc.stdout is not None
    output = (await proc.stdout.read()).decode()
    assert "service.forced_stop name=hangs reason=stop_grace" in output


_REPORTS_GC = textwrap.dedent(
    """
    import gc, sys
    from conveyor_runtime.service import GC_YOUNG_THRESHOLD, run_service
    from conveyor_runtime.settings import CommonSettings

    async def main(settings, stop):
        young = gc.get_threshold()[0]
        print("gc", gc.get_freeze_count() > 1000, young == GC_YOUNG_THRESHOLD, flush=True)

    sys.exit(run_service(main, CommonSettings(broker="memory"), name="gc"))
    """
)


async def test_a_service_process_freezes_its_start_up_heap_for_the_collector() -> None:
    """run_service moves what start-up made out of the collector's way (settle_heap)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _REPORTS_GC,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out
    assert b"gc True True" in out
