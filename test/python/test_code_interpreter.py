"""ember's Code Interpreter (the `code-interpreter-v1` template, internal/codeinterp/server.py)
driven from Python. E2B's own Python package, e2b-code-interpreter, cannot be installed here
(PyPI is not reachable and Debian has no package of it), so these tests speak its protocol
themselves, the way that package does: a sandbox from E2B's Python SDK (Sandbox.create), then
HTTP to port 49999 through ember's sandbox plane with the headers E2b-Sandbox-Id,
E2b-Sandbox-Port: 49999 and X-Access-Token (the sandbox's envd access token), over httpx:

  POST /execute {code, context_id, language, env_vars}  -> JSON lines (stdout, stderr, result,
       error, number_of_executions, end_of_execution), streamed as the code runs
  POST /contexts {language, cwd}, GET /contexts, POST /contexts/<id>/restart, DELETE /contexts/<id>

and the kernel's state through pause/resume and fork (Sandbox.pause, Sandbox.connect, Sandbox.fork).

Run by test/python/run.sh against a real daemon (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set);
each test_* function runs once, in order (pytest runs them the same way). `make sdk` runs it
after test/sdk/test/9-code-interpreter.test.mjs has built the template in the same data dir; on a
daemon without the template (e.g. `make python` on a fresh data dir) every test skips with the
reason, rather than build it (a create that names it would build it: many minutes).
"""
import base64
import json
import re
import sys
import time
import traceback

import httpx
from e2b import Sandbox, Template

try:
    import pytest

    def skip(reason):
        pytest.skip(reason)

    Skipped = pytest.skip.Exception
except ImportError:  # `import e2b` without the kit: no pytest needed to run this file
    class Skipped(Exception):
        pass

    def skip(reason):
        raise Skipped(reason)


TEMPLATE = "code-interpreter-v1"
PORT = 49999


class Interpreter:
    """The interpreter of one sandbox, reached as E2B's Code Interpreter SDK reaches it."""

    def __init__(self, sbx):
        self.sbx = sbx
        token = sbx._envd_access_token
        assert token, "the API gave the sandbox no envd access token"
        # With E2B_SANDBOX_URL (Mode A) every port is on the sandbox plane, chosen by the
        # headers; without it, https://<port>-<id>.<domain> (Mode B) routes by the host.
        host = sbx.get_host(PORT)
        assert host == f"{PORT}-{sbx.sandbox_id}.{sbx.sandbox_domain}", host
        self.url = sbx.connection_config._sandbox_url or f"https://{host}"
        self.headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": str(PORT),
            "X-Access-Token": token,
        }
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=60)

    def close(self):
        self.http.close()

    def execute(self, code, context_id=None, language=None, env_vars=None, timeout=60, client=None):
        """Runs code; returns what came back: stdout/stderr lines, results, the error, the
        execution count, and each message with the time it arrived (for streaming)."""
        body = {"code": code}
        if context_id:
            body["context_id"] = context_id
        if language:
            body["language"] = language
        if env_vars:
            body["env_vars"] = env_vars
        out = {"stdout": [], "stderr": [], "results": [], "error": None, "count": None, "end": False, "seen": []}
        with (client or self.http).stream("POST", "/execute", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                raise HTTPError(r.status_code, r.text)
            assert r.headers.get("content-type", "").startswith("application/x-ndjson"), r.headers
            for line in r.iter_lines():
                if not line.strip():
                    continue
                msg = json.loads(line)
                out["seen"].append((time.monotonic(), msg))
                kind = msg["type"]
                if kind in ("stdout", "stderr"):
                    out[kind].append(msg["text"])
                elif kind == "result":
                    out["results"].append(msg)
                elif kind == "error":
                    out["error"] = msg
                elif kind == "number_of_executions":
                    out["count"] = msg["execution_count"]
                elif kind == "end_of_execution":
                    out["end"] = True
        assert out["end"], f"no end_of_execution: {out['seen']}"
        return out

    def text(self, code, **kw):
        """The text of the main result of code (the value of its last expression)."""
        ex = self.execute(code, **kw)
        assert ex["error"] is None, ex["error"]
        main = [r for r in ex["results"] if r.get("is_main_result")]
        assert len(main) == 1, ex["results"]
        return main[0].get("text")

    def create_context(self, language="python", cwd=None):
        body = {"language": language}
        if cwd:
            body["cwd"] = cwd
        return self._json("POST", "/contexts", 200, json=body)

    def list_contexts(self):
        return self._json("GET", "/contexts", 200)

    def restart_context(self, cid):
        return self._json("POST", f"/contexts/{cid}/restart", 204)

    def delete_context(self, cid):
        return self._json("DELETE", f"/contexts/{cid}", 204)

    def _json(self, method, path, want, **kw):
        r = self.http.request(method, path, **kw)
        if r.status_code != want:
            raise HTTPError(r.status_code, r.text)
        return r.json() if r.content else None


class HTTPError(Exception):
    def __init__(self, status, body):
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


_state = {"sbx": None, "interp": None, "skip": None}


def interpreter():
    """The interpreter of this file's sandbox (made on first use; teardown_module kills it)."""
    if _state["skip"]:
        skip(_state["skip"])
    if _state["interp"] is None:
        if not Template.exists(TEMPLATE):
            _state["skip"] = (f"template {TEMPLATE} is not built on this daemon (test/sdk/test/9-code-interpreter.test.mjs "
                              "builds it in `make sdk`; a create here would build it, which takes many minutes)")
            skip(_state["skip"])
        sbx = Sandbox.create(TEMPLATE, timeout=600, envs={"SUITE_VAR": "hello-env"}, metadata={"suite": "ember-python-ci"})
        _state["sbx"], _state["interp"] = sbx, Interpreter(sbx)
    return _state["interp"]


def teardown_module(module=None):
    if _state["interp"] is not None:
        _state["interp"].close()
    if _state["sbx"] is not None:
        Sandbox.kill(_state["sbx"].sandbox_id)
    _state["sbx"] = _state["interp"] = None


def test_state_is_kept_and_the_last_expression_is_the_result():
    ci = interpreter()
    a = ci.execute("x = 41\nx")
    assert a["error"] is None and [r["text"] for r in a["results"]] == ["41"], a
    assert a["results"][0]["is_main_result"] is True
    b = ci.execute("x += 1\nx")
    assert [r["text"] for r in b["results"]] == ["42"], b
    assert isinstance(a["count"], int) and b["count"] > a["count"], (a["count"], b["count"])
    assert ci.text("'a string'") == "a string"  # a string's repr without its quotes, as E2B's
    nothing = ci.execute("y_unused = 1")
    assert nothing["results"] == [] and nothing["error"] is None, nothing


def test_print_is_streamed_as_it_happens():
    ci = interpreter()
    t0 = time.monotonic()
    ex = ci.execute("import sys, time\nprint('first', flush=True)\ntime.sleep(1.5)\n"
                    "print('oops', file=sys.stderr)\nprint('second')")
    end = time.monotonic()
    assert ex["stdout"] == ["first\n", "second\n"], ex["stdout"]
    assert ex["stderr"] == ["oops\n"], ex["stderr"]
    first = next(t for t, m in ex["seen"] if m["type"] == "stdout" and m["text"] == "first\n")
    assert end - first >= 1.0, f"'first' arrived {first - t0:.2f}s into a {end - t0:.2f}s run: not streamed"
    assert all(isinstance(m.get("timestamp"), int) for _, m in ex["seen"] if m["type"] in ("stdout", "stderr"))


def test_a_matplotlib_figure_is_a_png_result():
    ci = interpreter()
    ex = ci.execute("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()")
    assert ex["error"] is None, ex["error"]
    pngs = [r for r in ex["results"] if r.get("png")]
    assert len(pngs) == 1, [sorted(r) for r in ex["results"]]
    data = base64.b64decode(pngs[0]["png"])
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert len(data) > 1000, f"a PNG of {len(data)} bytes"
    assert pngs[0]["is_main_result"] is False  # shown (display_data), not the cell's value


def test_a_pandas_frame_is_text_html_and_data():
    ci = interpreter()
    ex = ci.execute("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert ex["error"] is None, ex["error"]
    main = [r for r in ex["results"] if r.get("is_main_result")]
    assert len(main) == 1, ex["results"]
    r = main[0]
    assert re.search(r"a\s+b", r["text"]), r["text"]
    assert "<table" in r["html"], r["html"]
    assert r["data"] == {"a": [1, 2], "b": ["x", "y"]}, r["data"]


def test_an_exception_is_an_error_object_and_the_context_goes_on():
    ci = interpreter()
    ci.execute("kept = 'still here'")
    ex = ci.execute("print('before')\ndef f():\n    return 1 / 0\nf()")
    assert ex["stdout"] == ["before\n"], ex["stdout"]
    err = ex["error"]
    assert err is not None, ex
    assert err["name"] == "ZeroDivisionError" and err["value"] == "division by zero", err
    tb = re.sub(r"\x1b\[[0-9;]*m", "", err["traceback"])  # IPython's colours, as E2B's server sends them
    assert "ZeroDivisionError" in tb and "return 1 / 0" in tb and "f()" in tb, tb
    assert ex["results"] == []
    assert ci.text("kept") == "still here"
    name = ci.execute("never_defined")["error"]
    assert name["name"] == "NameError" and "never_defined" in name["value"], name


def test_env_vars_per_call_and_the_sandbox_envs():
    ci = interpreter()
    code = "import os\nos.environ.get('CALL_VAR', 'unset')"
    assert ci.text(code, env_vars={"CALL_VAR": "per-call"}) == "per-call"
    assert ci.text(code) == "unset", "a call's env vars are gone after it"
    # A variable the kernel already has comes back to its value after the call.
    ci.execute("import os\nos.environ['KEEP_VAR'] = 'kernel'")
    assert ci.text("os.environ['KEEP_VAR']", env_vars={"KEEP_VAR": "call"}) == "call"
    assert ci.text("os.environ['KEEP_VAR']") == "kernel"
    # The envs given to Sandbox.create reach the kernel, which was started before the sandbox.
    assert ci.text("import os\nos.environ.get('SUITE_VAR')") == "hello-env"


def test_a_timeout_interrupts_the_kernel_and_leaves_the_context_usable():
    ci = interpreter()
    ci.execute("t_var = 42")
    t0 = time.monotonic()
    # As the SDK's timeout does: the client gives up and closes its connection.
    with httpx.Client(base_url=ci.url, headers=ci.headers) as one:
        try:
            ci.execute("import time\nprint('started', flush=True)\ntime.sleep(60)\nt_var = 0",
                       timeout=httpx.Timeout(10, read=2), client=one)
            raise AssertionError("a 60 s sleep returned within a 2 s read timeout")
        except httpx.ReadTimeout:
            pass
    # The next run is not queued behind the sleep, and the cell stopped before `t_var = 0`.
    assert ci.text("t_var") == "42"
    took = time.monotonic() - t0
    assert took < 20, f"the context answered {took:.1f}s after the timed-out run began"
    ex = ci.execute("print('after')")
    assert ex["stdout"] == ["after\n"] and ex["error"] is None, ex


def test_contexts_create_list_restart_delete():
    ci = interpreter()
    ci.execute("x = 42")
    ctx = ci.create_context("python", cwd="/tmp")
    assert ctx["id"] and ctx["language"] == "python" and ctx["cwd"] == "/tmp", ctx
    cid = ctx["id"]
    assert ci.text("import os\nos.getcwd()", context_id=cid) == "/tmp"
    iso = ci.execute("x", context_id=cid)
    assert iso["error"] and iso["error"]["name"] == "NameError", "a new context does not see the default one's state"
    ci.execute("y = 5", context_id=cid)
    assert ci.text("y * 2", context_id=cid) == "10"
    listed = ci.list_contexts()
    assert any(c["id"] == cid and c["cwd"] == "/tmp" for c in listed), listed
    assert any(c["id"] != cid for c in listed), "the default context is listed too"
    ci.restart_context(cid)
    assert ci.execute("y", context_id=cid)["error"]["name"] == "NameError", "a restart clears the state"
    assert ci.text("import os\nos.getcwd()", context_id=cid) == "/tmp", "a restart keeps the cwd"
    ci.delete_context(cid)
    assert not any(c["id"] == cid for c in ci.list_contexts())
    for call in (lambda: ci.execute("1", context_id=cid), lambda: ci.delete_context(cid), lambda: ci.restart_context(cid)):
        try:
            call()
            raise AssertionError("a deleted context answered")
        except HTTPError as e:
            assert e.status == 404, e
    assert ci.text("x") == "42", "the default context is untouched"


def test_a_language_without_a_kernel_is_refused():
    # Python (a Jupyter kernel) and bash (a shell per context) are served; JavaScript has no
    # kernel in Debian's packages.
    ci = interpreter()
    for call in (lambda: ci.execute("1 + 1", language="js"), lambda: ci.execute("1", language="javascript"), lambda: ci.create_context("cobol")):
        try:
            call()
            raise AssertionError("an unsupported language was accepted")
        except HTTPError as e:
            assert e.status == 400 and "not supported" in e.body, e


def test_pause_and_resume_keep_the_kernel_state():
    ci = interpreter()
    ci.execute("import numpy as np\nz = np.arange(7)")
    sid = ci.sbx.sandbox_id
    assert ci.sbx.pause()
    try:
        ci.execute("1", timeout=10)
        raise AssertionError("the interpreter of a paused sandbox answered")
    except HTTPError as e:
        assert e.status == 502, e  # E2B's answer for a sandbox that does not run
    again = Sandbox.connect(sid, timeout=600)
    ci2 = Interpreter(again)
    try:
        assert ci2.text("int(z.sum() * 2)") == "42"
        assert ci2.text("x") == "42", "a variable of an earlier test is there too"
    finally:
        ci2.close()


def test_fork_children_have_the_state_and_diverge():
    ci = interpreter()
    ci.execute("w = 1")
    kids = Sandbox.fork(ci.sbx.sandbox_id, count=2, timeout=300)
    started = [k for k in kids if isinstance(k, Sandbox)]
    interps = []
    try:
        assert len(started) == 2, f"forks failed: {kids}"
        interps = [Interpreter(k) for k in started]
        for k in interps:
            assert k.text("w") == "1", f"child {k.sbx.sandbox_id}"
            assert k.text("x") == "42", "the parent's earlier state too"
        interps[0].execute("w = 100")
        assert interps[0].text("w") == "100"
        assert interps[1].text("w") == "1", "a child's change is its own"
        assert ci.text("w") == "1", "the parent goes on as it was"
    finally:
        for k in interps:
            k.close()
        for k in started:
            Sandbox.kill(k.sandbox_id)


def main():
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    failed = skipped = 0
    t_all = time.monotonic()
    try:
        for name, fn in tests:
            t0 = time.monotonic()
            try:
                fn()
                print(f"ok   {name} ({time.monotonic() - t0:.1f}s)")
            except Skipped as e:
                skipped += 1
                print(f"skip {name}: {e}")
            except Exception:
                failed += 1
                print(f"FAIL {name} ({time.monotonic() - t0:.1f}s)")
                traceback.print_exc()
    finally:
        teardown_module()
    print(f"{len(tests) - failed - skipped} passed, {failed} failed, {skipped} skipped in {time.monotonic() - t_all:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
