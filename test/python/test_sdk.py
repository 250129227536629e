"""ember through E2B's Python SDK: create, commands, files, pause/resume, kill, and an
out-of-memory that kills only the command. Run by test/python/run.sh against a real daemon
(E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set); each test_* function runs once, in order.
"""
import sys
import time
import traceback

from e2b import CommandExitException, Sandbox, SandboxQuery


def test_create_run_files_kill():
    sbx = Sandbox.create("base", timeout=120, metadata={"suite": "ember-python"})
    try:
        assert sbx.is_running()
        r = sbx.commands.run("echo hello; echo oops >&2")
        assert r.exit_code == 0 and r.stdout == "hello\n" and r.stderr == "oops\n", r
        try:
            sbx.commands.run("exit 3")
            raise AssertionError("exit 3 did not raise")
        except CommandExitException as e:
            assert e.exit_code == 3, e
        sbx.files.write("/home/user/dir/a.txt", "content of a")
        assert sbx.files.read("/home/user/dir/a.txt") == "content of a"
        names = [e.name for e in sbx.files.list("/home/user/dir")]
        assert names == ["a.txt"], names
        assert sbx.commands.run("cat /home/user/dir/a.txt").stdout == "content of a"
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "ember-python"})).next_items()]
        assert sbx.sandbox_id in ids, ids
    finally:
        assert sbx.kill()
    assert not sbx.is_running()
    assert not Sandbox.kill(sbx.sandbox_id)  # already gone: False, as E2B answers 404


def test_pause_resume():
    sbx = Sandbox.create("base", timeout=120)
    try:
        sbx.files.write("/tmp/state.txt", "before pause")
        sbx.commands.run("sleep 600", background=True)
        assert sbx.pause()
        assert not Sandbox.pause(sbx.sandbox_id)  # already paused
        assert not sbx.is_running()
        assert sbx.get_info().state.value == "paused"
        again = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert again.is_running()
        assert again.files.read("/tmp/state.txt") == "before pause"
        assert "sleep 600" in again.commands.run("ps -eo args").stdout  # memory kept
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_out_of_memory_kills_only_the_command():
    sbx = Sandbox.create("base", timeout=120)
    try:
        t0 = time.monotonic()
        try:
            sbx.commands.run('python3 -c "bytearray(8 << 30)"')
            raise AssertionError("an 8 GiB allocation succeeded in a 1 GiB sandbox")
        except CommandExitException as e:
            # Killed by SIGKILL, as in a VM: envd's exit code -1, "signal: killed".
            assert e.exit_code == -1 and e.error == "signal: killed", (e.exit_code, e.error)
        print(f"  8 GiB allocation killed after {time.monotonic() - t0:.2f}s")
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert sbx.is_running()
    finally:
        sbx.kill()


def main():
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    failed = 0
    t_all = time.monotonic()
    for name, fn in tests:
        t0 = time.monotonic()
        try:
            fn()
            print(f"ok   {name} ({time.monotonic() - t0:.1f}s)")
        except Exception:
            failed += 1
            print(f"FAIL {name} ({time.monotonic() - t0:.1f}s)")
            traceback.print_exc()
    print(f"{len(tests) - failed} passed, {failed} failed in {time.monotonic() - t_all:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
