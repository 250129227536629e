#!/usr/bin/env python3
"""ember's Code Interpreter server.

It speaks the protocol of E2B's Code Interpreter SDK (@e2b/code-interpreter, e2b-code-interpreter)
on port 49999 inside a sandbox of the `code-interpreter-v1` template, over Jupyter kernels run with
jupyter_client (Debian's python3-jupyter-client and python3-ipykernel):

  GET    /health                 200 once the default context's kernel answers
  POST   /execute                {code, context_id, language, env_vars}: a stream of JSON lines
                                 (stdout, stderr, result, error, number_of_executions, end_of_execution)
  POST   /contexts               {language, cwd}: a new context {id, language, cwd}
  GET    /contexts               the contexts
  POST   /contexts/<id>/restart  a fresh kernel in the same context
  DELETE /contexts/<id>          the context's kernel is shut down

A context is one kernel (Python) or one bash process (bash: Debian packages no bash kernel);
its executions run one at a time. An execution whose client goes away
(the SDK's timeoutMs aborts the request) interrupts the kernel, which stays usable. Only the
standard library and jupyter_client are used (no web framework).
"""

import http.client
import json
import os
import queue
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client import KernelManager

PORT = int(os.environ.get("EMBER_CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("EMBER_CODE_INTERPRETER_CWD", "/home/user")
ENVD_HOST, ENVD_PORT = "127.0.0.1", 49983
# Languages and their canonical names: Python on a Jupyter kernel; bash on a shell of ember's
# own (BashContext: Debian has no bash Jupyter kernel).
LANGUAGES = {"python": "python", "python3": "python", "bash": "bash", "sh": "bash", "shell": "bash"}

# Run (silently) in every new kernel: the e2b/data formatter for pandas frames (the SDK's
# Result.data), registered by name so pandas is imported only when a frame is shown, and the
# e2b/chart formatter of matplotlib figures (CHARTS, run before it).
SETUP = r"""
def __ember_setup():
    import json
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

    def frame(df):
        # Column -> values, JSON-safe (numpy scalars, NaN, timestamps through pandas' own JSON).
        return {str(c): json.loads(df[c].to_json(orient="values", date_format="iso")) for c in df.columns}

    disp = get_ipython().display_formatter
    f = DataFormatter(parent=disp)
    f.for_type_by_name("pandas.core.frame", "DataFrame", frame)
    disp.formatters["e2b/data"] = f
    if disp.active_types and "e2b/data" not in disp.active_types:
        disp.active_types = list(disp.active_types) + ["e2b/data"]

    chart = __ember_chart

    class ChartFormatter(DataFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")

        def __call__(self, obj):
            # Not a registered printer: the inline backend drops every formatter's Figure
            # printer when pyplot is imported.
            cls = type(obj)
            if self.enabled and cls.__name__ == "Figure" and cls.__module__ == "matplotlib.figure":
                return chart(obj)
            return None

    f = ChartFormatter(parent=disp)
    disp.formatters["e2b/chart"] = f
    if disp.active_types and "e2b/chart" not in disp.active_types:
        disp.active_types = list(disp.active_types) + ["e2b/chart"]

    # Every execution ends with a flush of stdout and stderr, each a round trip through the
    # kernel's iopub thread, and a 0.5 ms sleep: under gVisor, more than half of a
    # runCode('1+1') in the kernel. A stream with nothing written since its last flush has
    # nothing to send (this server waits for the kernel's idle status on iopub, which comes
    # after any output, not for the reply on the shell channel).
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is not None and hasattr(kernel, "_execute_sleep"):
        kernel._execute_sleep = 0
    import sys
    try:
        from ipykernel.iostream import OutStream
    except ImportError:
        return
    if not all(isinstance(s, OutStream) and hasattr(s, "_buffer") and hasattr(s, "_buffer_lock") and hasattr(s, "_flush_pending")
               for s in (sys.stdout, sys.stderr)):
        return  # an ipykernel whose streams are not as read here: left as it is
    flush = OutStream.flush

    def lazy_flush(self):
        if not self._flush_pending and not getattr(self, "_subprocess_flush_pending", False):
            with self._buffer_lock:
                if self._buffer.tell() == 0:
                    return
        flush(self)

    OutStream.flush = lazy_flush

__ember_setup()
del __ember_setup, __ember_chart
"""

# The e2b/chart formatter (the SDK's Result.chart): what a matplotlib figure shows, read from its
# artists, in the form of the SDKs' chart types (ChartTypes in @e2b/code-interpreter). One axes is
# a line, scatter, bar, pie or box-and-whisker chart; several are a superchart of them. A figure
# it cannot read gives no chart (never an error: the PNG is shown all the same).
CHARTS = r"""
def __ember_chart(fig):
    import math, re
    try:
        import matplotlib.category as mcat
        import matplotlib.dates as mdates
        from matplotlib.container import BarContainer
        from matplotlib.collections import PathCollection
        from matplotlib.patches import PathPatch, Wedge
    except Exception:
        return None

    def number(v):
        try:
            v = float(v)
        except (TypeError, ValueError):
            return str(v)
        return v if math.isfinite(v) else None

    def unit(label):
        m = re.search(r"[(\[]([^()\[\]]+)[)\]]\s*$", label or "")
        return m.group(1) if m else None

    def scale(axis):
        fmt = axis.get_major_formatter()
        if isinstance(fmt, (mdates.DateFormatter, mdates.AutoDateFormatter, mdates.ConciseDateFormatter)):
            return "datetime"
        if isinstance(fmt, mcat.StrCategoryFormatter):
            return "categorical"
        return axis.get_scale()

    def value(axis, kind):
        # A data coordinate as the user gave it: a date as ISO 8601, a category by its name.
        if kind == "datetime":
            return lambda v: mdates.num2date(float(v)).isoformat()
        if kind == "categorical":
            names = {v: k for k, v in getattr(axis.units, "_mapping", {}).items()}
            return lambda v: str(names.get(v, names.get(int(round(float(v))), v)))
        return number

    def ticks(axis, kind):
        locs = list(axis.get_ticklocs())
        try:
            labels = [str(t) for t in axis.get_major_formatter().format_ticks(locs)]
        except Exception:
            labels = [str(t) for t in locs]
        return [value(axis, kind)(t) for t in locs], labels

    def base(ax, kind, xy=True, swap=False):
        # x_* name the category axis of a bar or box chart, as E2B's: a horizontal one's y axis.
        out = {"type": kind, "title": ax.get_title(), "elements": []}
        if xy:
            x, y = ax.get_xlabel() or None, ax.get_ylabel() or None
            if swap:
                x, y = y, x
            out["x_label"], out["y_label"] = x, y
            out["x_unit"], out["y_unit"] = unit(x), unit(y)
        return out

    def points(ax, kind, series):
        out = base(ax, kind)
        xs, ys = scale(ax.xaxis), scale(ax.yaxis)
        fx, fy = value(ax.xaxis, xs), value(ax.yaxis, ys)
        out["x_scale"], out["y_scale"] = xs, ys
        out["x_ticks"], out["x_tick_labels"] = ticks(ax.xaxis, xs)
        out["y_ticks"], out["y_tick_labels"] = ticks(ax.yaxis, ys)
        out["elements"] = [{"label": label, "points": [[fx(x), fy(y)] for x, y in xy]} for label, xy in series]
        return out

    def at(axis, loc):
        # The category (tick label) at a bar's or a box's position on axis.
        kind = scale(axis)
        if kind in ("categorical", "datetime"):
            return str(value(axis, kind)(loc))
        locs, labels = ticks(axis, kind)
        for l, name in zip(locs, labels):
            if isinstance(l, float) and abs(l - loc) < 1e-9 * max(1.0, abs(loc)):
                return name
        return str(number(loc))

    def text(v):
        # A bar's value as the SDKs type it (a string), in Python's shortest form ("10", "2.5").
        v = number(v)
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
            return str(int(v))
        return str(v)

    def bar(ax, bars):
        horizontal = all(getattr(c, "orientation", None) == "horizontal" for c in bars)
        out = base(ax, "bar", swap=horizontal)
        axis = ax.yaxis if horizontal else ax.xaxis
        for c in bars:
            group = c.get_label() or ""
            if re.fullmatch(r"_container\d+", group):  # no label given: matplotlib's name, as E2B shows it
                group = "Group %s" % group[len("_container"):]
            for r in c.patches:
                loc = r.get_y() + r.get_height() / 2 if horizontal else r.get_x() + r.get_width() / 2
                out["elements"].append({"label": at(axis, loc), "value": text(r.get_width() if horizontal else r.get_height()),
                                        "group": group})
        return out

    def box_and_whisker(ax):
        # What ax.boxplot drew, read back: a box (a closed line, or a PathPatch with patch_artist)
        # spans the quartiles; a whisker is a segment on the box's centre line from an edge; the
        # median the widest cross segment inside the box; outliers the markers on the centre line.
        shapes, segs, marks = [], [], []
        for l in ax.get_lines():
            xs = [float(v) for v in l.get_xdata(orig=False)]
            ys = [float(v) for v in l.get_ydata(orig=False)]
            if str(l.get_linestyle()).lower() in ("none", "", " "):
                marks.append((xs, ys))
            elif len(xs) >= 5 and xs[0] == xs[-1] and ys[0] == ys[-1]:
                shapes.append((min(xs), max(xs), min(ys), max(ys)))
            elif len(xs) == 2:
                segs.append((xs, ys))
            else:
                return None
        for p in ax.patches:
            if not isinstance(p, PathPatch):
                return None
            e = p.get_path().get_extents()  # not the vertices: a closed path's last one is a placeholder
            shapes.append((float(e.x0), float(e.x1), float(e.y0), float(e.y1)))
        if not shapes:
            return None

        def near(a, b):
            return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))

        def read(shape, vertical):
            # The whiskers run from the quartiles (not the box's extent: a notch can reach past them).
            p0, p1, v0, v1 = shape if vertical else shape[2:] + shape[:2]
            mid, tol = (p0 + p1) / 2, 1e-9 * max(1.0, abs(v0), abs(v1))
            whiskers, cross = [], []
            for xs, ys in segs:
                pos, val = (xs, ys) if vertical else (ys, xs)
                if near(pos[0], mid) and near(pos[1], mid) and any(v0 - tol <= v <= v1 + tol for v in val):
                    whiskers.append(sorted(val))
                elif val[0] == val[1] and p0 - tol <= min(pos) and max(pos) <= p1 + tol:
                    cross.append((max(pos) - min(pos), val[0]))
            if len(whiskers) != 2:
                return mid, None
            (lo, q1), (q3, hi) = sorted(whiskers)
            inside = [c for c in cross if q1 <= c[1] <= q3]
            outliers = []
            for xs, ys in marks:
                pos, val = (xs, ys) if vertical else (ys, xs)
                outliers += [v for p, v in zip(pos, val) if near(p, mid)]
            return mid, {"min": lo, "first_quartile": q1, "median": max(inside)[1] if inside else None,
                         "third_quartile": q3, "max": hi, "outliers": outliers}

        found = {v: [read(s, v) for s in shapes] for v in (True, False)}
        vertical = all(b is not None for _, b in found[True])
        if not vertical and not all(b is not None for _, b in found[False]):
            return None
        out = base(ax, "box_and_whisker", swap=not vertical)
        axis = ax.xaxis if vertical else ax.yaxis
        for mid, b in found[vertical]:
            el = {"label": at(axis, mid)}
            el.update({k: [number(o) for o in v] if k == "outliers" else number(v) for k, v in b.items()})
            out["elements"].append(el)
        return out

    def chart(ax):
        wedges = [p for p in ax.patches if isinstance(p, Wedge)]
        if wedges:
            out = base(ax, "pie", xy=False)
            out["elements"] = [{"label": w.get_label(), "angle": number(round(abs(w.theta2 - w.theta1), 4)), "radius": number(w.r)}
                               for w in wedges]
            return out
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        if bars:
            return bar(ax, bars)
        box = box_and_whisker(ax)
        if box is not None:
            return box
        dots = [c for c in ax.collections if isinstance(c, PathCollection)]
        if dots:
            return points(ax, "scatter", [(c.get_label(), c.get_offsets()) for c in dots])
        lines = ax.get_lines()
        if lines:
            return points(ax, "line", [(l.get_label(), zip(l.get_xdata(orig=False), l.get_ydata(orig=False))) for l in lines])
        return {"type": "unknown", "title": ax.get_title(), "elements": []}

    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        if not axes:
            return None
        if len(axes) == 1:
            return chart(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
        return {"type": "superchart", "title": title, "elements": [chart(ax) for ax in axes]}
    except Exception:
        return None
"""

# Imported once in the default kernel before the template is checkpointed, so that a sandbox's
# first use of them is a dictionary lookup; a first figure also builds matplotlib's font cache.
WARM = r"""
def __ember_warm():
    import numpy, pandas, matplotlib
    import matplotlib.pyplot as plt
    fig = plt.figure()
    plt.plot([0, 1], [0, 1])
    import io
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)

__ember_warm()
del __ember_warm
"""

MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def log(*args):
    print("code-interpreter:", *args, file=sys.stderr, flush=True)


class KernelError(Exception):
    pass


class Gone(Exception):
    """The client of an execution went away."""


def result_message(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        field = MIME.get(mime)
        if field:
            out[field] = value
        else:
            extra[mime] = value
    text = out.get("text")
    # As E2B's server: a string's repr is given without its quotes.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] == "'":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


class BaseContext:
    """What every execution context has: an id, a language, a working directory, and a lock
    its executions take (one at a time). A subclass starts its interpreter in _start."""

    def __init__(self, language, cwd, cid=None):
        self.id = cid or str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.env_key = None  # the sandbox whose environment the interpreter has
        self._start()

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class Context(BaseContext):
    """One Python execution context: a kernel, its client, and the environment applied to it."""

    km = None

    def _start(self):
        env = dict(os.environ)
        env.pop("EMBER_CODE_INTERPRETER_PORT", None)
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # the debugger's warning on every start
        km = KernelManager(kernel_name="python3")
        # IPython's input history in memory (In, Out and %history work as before): in its
        # history.sqlite every execution was a committed, fsynced write, which doubled the
        # time of a runCode('1+1') under gVisor.
        km.start_kernel(cwd=self.cwd, env=env, extra_arguments=["--HistoryManager.hist_file=:memory:"])
        # Plain (blocking) zmq sockets and the kernel's session: jupyter_client's blocking client
        # runs an asyncio loop per call, which tripled a round trip here.
        self.km, self.session = km, km.session
        self.shell, self.iopub = km.connect_shell(), km.connect_iopub()
        try:
            self._wait_ready(120)
        except KernelError:
            self.stop()
            raise
        self.sandbox_env, self.env_key = {}, None
        self.silent(CHARTS + SETUP)

    def _send(self, kind, content):
        msg = self.session.msg(kind, content=content)
        self.session.send(self.shell, msg)
        return msg["header"]["msg_id"]

    def _recv(self, sock):
        _, parts = self.session.feed_identities(sock.recv_multipart())
        return self.session.deserialize(parts)

    def _wait_ready(self, timeout):
        """Waits for the kernel's reply to kernel_info and for the iopub subscription to carry
        messages (a SUB socket drops what is published before it is connected)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.km.is_alive():
                raise KernelError("the kernel exited at start")
            mid = self._send("kernel_info_request", {})
            replied = False
            while self.shell.poll(1000):
                if self._recv(self.shell)["parent_header"].get("msg_id") == mid:
                    replied = True
                    break
            if replied and self.iopub.poll(500):
                while self.iopub.poll(50):
                    self._recv(self.iopub)
                return
        raise KernelError("the kernel did not answer within %ds" % timeout)

    def stop(self):
        for sock in (getattr(self, "shell", None), getattr(self, "iopub", None)):
            if sock is not None:
                sock.close(linger=0)
        self.shell = self.iopub = None
        if self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception as e:  # a kernel that is already gone
                log("shutdown:", e)

    def restart(self):
        with self.lock:
            self.stop()
            self._start()

    def _run(self, code, silent, on_msg, gone=None, prelude=None):
        """Runs code and passes its iopub messages to on_msg until the kernel is idle again.
        Returns the execution count. When gone() says the client left (or on_msg raises Gone),
        the kernel is interrupted and the run drained, so the context stays usable. prelude,
        if any, is code run silently just before, sent with it (the kernel runs its requests
        in order: no round trip of its own); its errors are logged."""
        while self.shell.poll(0):  # replies nobody waited for
            self._recv(self.shell)
        pre_id = None
        if prelude:
            pre_id = self._send("execute_request", {"code": prelude, "silent": True, "store_history": False,
                                                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
        msg_id = self._send("execute_request", {"code": code, "silent": silent, "store_history": not silent,
                                                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        interrupted = False
        count = None

        def interrupt():
            nonlocal interrupted
            if not interrupted:
                interrupted = True
                self.km.interrupt_kernel()

        flush = getattr(on_msg, "flush", None)
        while True:
            if flush is not None and not interrupted and not self.iopub.poll(0):
                # Nothing more is ready: what was emitted goes out before the wait (one write
                # for the messages of a burst, streamed all the same).
                try:
                    flush()
                except Gone:
                    interrupt()
            if not self.iopub.poll(100):
                if not self.km.is_alive():
                    raise KernelError("the kernel died")
                if gone is not None and gone():
                    interrupt()
                continue
            msg = self._recv(self.iopub)
            parent = msg["parent_header"].get("msg_id")
            if parent != msg_id:
                if parent == pre_id and msg["msg_type"] == "error":
                    log("prelude: %s: %s" % (msg["content"].get("ename"), msg["content"].get("evalue")))
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                if content.get("execution_state") == "idle":
                    break
                continue
            if kind == "execute_input":
                count = content.get("execution_count")
            if interrupted:
                continue
            try:
                on_msg(kind, content)
            except Gone:
                interrupt()
        return count

    def silent(self, code):
        errors = []

        def on_msg(kind, content):
            if kind == "error":
                errors.append("%s: %s" % (content.get("ename"), content.get("evalue")))

        self._run(code, True, on_msg)
        if errors:
            raise KernelError(errors[0])

    def sync_sandbox_env(self, token):
        """The code that applies the sandbox's environment (envd's /envs: the envs given at
        create) once per sandbox, or None: a template's kernel was started before the sandbox
        existed."""
        key = (socket.gethostname(), token)
        if key == self.env_key:
            return None
        envs = sandbox_envs(token)
        if envs is None:
            return None
        self.env_key = key
        # The kernel started with this server's environment: only what differs is sent.
        changed = {k: v for k, v in envs.items() if self.sandbox_env.get(k, os.environ.get(k)) != v}
        if not changed:
            return None
        self.sandbox_env.update(changed)
        return "import os as __o\n__o.environ.update(%r)\ndel __o\n" % (changed,)

    def execute(self, code, env_vars, token, emit, gone):
        with self.lock:
            prelude = self.sync_sandbox_env(token) or ""
            if env_vars:
                prelude += ("import os as __o\n__ember_saved_env = {k: __o.environ.get(k) for k in %r}\n"
                            "__o.environ.update(%r)\ndel __o\n" % (list(env_vars), env_vars))
            def on_msg(kind, content):
                if kind == "stream":
                    emit({"type": "stderr" if content.get("name") == "stderr" else "stdout", "text": content.get("text", ""),
                          "timestamp": time.time_ns() // 1000})
                elif kind in ("execute_result", "display_data"):
                    emit(result_message(content.get("data", {}), kind == "execute_result"))
                elif kind == "error":
                    emit({"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                          "traceback": "\n".join(content.get("traceback", []))})

            on_msg.flush = getattr(emit, "flush", None)
            try:
                n = self._run(code, False, on_msg, gone, prelude)
            finally:
                if env_vars:
                    self.silent(
                        "import os as __o\nfor __k, __v in __ember_saved_env.items():\n"
                        "    __o.environ.pop(__k, None) if __v is None else __o.environ.__setitem__(__k, __v)\n"
                        "del __o, __k, __v, __ember_saved_env"
                    )
            if n is not None:
                emit({"type": "number_of_executions", "execution_count": n})
            emit({"type": "end_of_execution"})


def sandbox_envs(token):
    """The sandbox's environment (envd's /envs: the envs given at create), or None when it
    could not be had this time. Refused (a request without the sandbox's access token): {},
    nothing to apply, so that the caller does not ask again for the same token. Asked with
    http.client: urllib's first request in a sandbox (its opener, the proxy settings) took
    several times as long, on the first runCode after a create."""
    conn = http.client.HTTPConnection(ENVD_HOST, ENVD_PORT, timeout=2)
    try:
        conn.request("GET", "/envs", headers={"X-Access-Token": token} if token else {})
        r = conn.getresponse()
        body = r.read()
        if r.status in (401, 403):
            log("envd /envs refused (HTTP %d): the sandbox's environment is not applied for this token" % r.status)
            return {}
        if r.status != 200:
            raise OSError("HTTP %d: %s" % (r.status, body[:200].decode(errors="replace")))
        return json.loads(body) or {}
    except Exception as e:
        log("envd /envs:", e)
        return None
    finally:
        conn.close()


class BashContext(BaseContext):
    """A bash context: one long-lived bash whose state (variables, functions, cwd) carries from
    one execution to the next. A cell is sourced from a file (its stdin is /dev/null); its output
    is streamed line by line; a non-zero exit status is an error (name "Error", the status as
    value, as Jupyter's bash kernel reports it). An interrupted cell (timeout) or one that exits
    the shell leaves a fresh shell: the context stays usable, its state is lost."""

    count = 0
    proc = None

    def _start(self):
        env = dict(os.environ)
        env.pop("EMBER_CODE_INTERPRETER_PORT", None)
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=self.cwd, env=env, start_new_session=True)
        self.env_key = None

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                f.close()
            self.proc = None

    def restart(self):
        with self.lock:
            self.stop()
            self._start()

    def execute(self, code, env_vars, token, emit, gone):
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.stop()
                self._start()
            script = []
            key = (socket.gethostname(), token)
            if key != self.env_key:
                envs = sandbox_envs(token)
                if envs is not None:
                    script += ["export %s=%s" % (k, shlex.quote(v)) for k, v in envs.items() if k.isidentifier()]
                    self.env_key = key
            # Env vars for this call only: set, then restored (or unset) after the cell.
            names = [k for k in env_vars if k.isidentifier()]
            for k in names:
                script.append('__ember_saved_%s="${%s+x}${%s-}"; export %s=%s' % (k, k, k, k, shlex.quote(env_vars[k])))
            cell = "/tmp/.ember-bash-%s.sh" % self.id
            fd = os.open(cell, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(code + "\n")
            marker = "__ember_end_%s" % uuid.uuid4().hex
            script.append("source %s </dev/null; __ember_rc=$?" % shlex.quote(cell))
            for k in names:
                script.append('if [ -n "$__ember_saved_%s" ]; then export %s="${__ember_saved_%s#x}"; else unset %s; fi; unset __ember_saved_%s'
                              % (k, k, k, k, k))
            script.append("printf '%s %%d\\n' \"$__ember_rc\"; printf '%s\\n' >&2" % (marker, marker))
            self.proc.stdin.write(("\n".join(script) + "\n").encode())
            self.proc.stdin.flush()
            self.count += 1
            rc = self._stream(marker, emit, gone)
            if rc is None:  # interrupted, or the cell ended the shell: a fresh one
                self.stop()
                self._start()
                emit({"type": "error", "name": "Error", "value": "the shell ended", "traceback": ""})
            elif rc != 0:
                emit({"type": "error", "name": "Error", "value": str(rc), "traceback": ""})
            emit({"type": "number_of_executions", "execution_count": self.count})
            emit({"type": "end_of_execution"})

    def _stream(self, marker, emit, gone):
        """Streams the cell's output until both end markers; returns the cell's exit status,
        or None when the client left (the shell is then killed) or the shell ended."""
        out, err = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        bufs = {out: b"", err: b""}
        names = {out: "stdout", err: "stderr"}
        mark = marker.encode()
        rc, open_fds = None, [out, err]
        while open_fds:
            ready, _, _ = select.select(open_fds, [], [], 0.1)
            if not ready:
                if gone():
                    return None
                continue
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    return None
                bufs[fd] += data
                *lines, bufs[fd] = bufs[fd].split(b"\n")
                for line in lines:
                    i = line.find(mark)
                    if i >= 0:
                        if i > 0:  # the cell's last line, without its newline
                            emit({"type": names[fd], "text": line[:i].decode(errors="replace"), "timestamp": time.time_ns() // 1000})
                        if fd == out:
                            rc = int(line[i + len(mark):].strip() or b"0")
                        open_fds.remove(fd)
                        break
                    emit({"type": names[fd], "text": line.decode(errors="replace") + "\n", "timestamp": time.time_ns() // 1000})
            flush = getattr(emit, "flush", None)
            if flush is not None:
                flush()
        return rc


def new_context(language, cwd):
    return BashContext(language, cwd) if language == "bash" else Context(language, cwd)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = {}  # language -> context

    def create(self, language, cwd):
        ctx = new_context(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language):
        with self.lock:
            ctx = self.default.get(language)
        if ctx is not None:
            return ctx
        ctx = new_context(language, DEFAULT_CWD)
        with self.lock:
            if language in self.default:  # made meanwhile by another request
                ctx.stop()
                return self.default[language]
            self.default[language] = ctx
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            for lang, d in list(self.default.items()):
                if d is ctx:
                    del self.default[lang]
        if ctx is not None:
            with ctx.lock:
                ctx.stop()
        return ctx is not None

    def all(self):
        with self.lock:
            return list(self.by_id.values())


CONTEXTS = Contexts()
READY = threading.Event()


def language_of(value):
    lang = (value or "python").strip().lower()
    if lang not in LANGUAGES:
        raise ValueError("language %r is not supported here (supported: python, bash)" % value)
    return LANGUAGES[lang]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a response's last segment is not held back waiting for the client's
    # (delayed) ACK of the one before it.
    disable_nagle_algorithm = True
    server_version = "ember-code-interpreter"

    def log_message(self, fmt, *args):
        pass

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n == 0:
            return {}
        data = json.loads(self.rfile.read(n) or b"{}")
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")
        return data

    def _send(self, status, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message):
        self._send(status, {"error": message, "message": message})

    def do_GET(self):
        if self.path.split("?")[0] == "/health":
            if READY.is_set():
                self._send(200, "OK")
            else:
                self._error(503, "the default context is starting")
            return
        if self.path.split("?")[0] == "/contexts":
            self._send(200, [c.info() for c in CONTEXTS.all()])
            return
        self._error(404, "not found: %s" % self.path)

    def do_DELETE(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            if CONTEXTS.remove(parts[1]):
                self._send(204)
            else:
                self._error(404, "context %s not found" % parts[1])
            return
        self._error(404, "not found: %s" % self.path)

    def do_POST(self):
        path = self.path.split("?")[0]
        parts = path.strip("/").split("/")
        try:
            body = self._body()
        except ValueError as e:
            self._error(400, "invalid request body: %s" % e)
            return
        try:
            if path == "/execute":
                self._execute(body)
            elif path == "/contexts":
                lang = language_of(body.get("language"))
                ctx = CONTEXTS.create(lang, body.get("cwd") or DEFAULT_CWD)
                self._send(200, ctx.info())
            elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                ctx = CONTEXTS.get(parts[1])
                if ctx is None:
                    self._error(404, "context %s not found" % parts[1])
                    return
                ctx.restart()
                self._send(204)
            else:
                self._error(404, "not found: %s" % self.path)
        except ValueError as e:
            self._error(400, str(e))
        except KernelError as e:
            self._error(500, str(e))

    def _client_gone(self):
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise ValueError("code must be a string")
        env_vars = body.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise ValueError("env_vars must be an object")
        env_vars = {str(k): str(v) for k, v in env_vars.items()}
        cid = body.get("context_id")
        if cid:
            ctx = CONTEXTS.get(cid)
            if ctx is None:
                self._error(404, "context %s not found" % cid)
                return
        else:
            ctx = CONTEXTS.default_for(language_of(body.get("language")))
        state = {"gone": False}
        # What is emitted and not yet written, the response's head first: a short run's whole
        # response is one write.
        pending = [b"HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Type: application/x-ndjson\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" % self.server_version.encode()]

        def emit(msg):
            """Queues one JSON line; it is written by the next flush (the kernel's loop flushes
            whenever it waits, so output streams as it comes, in as few writes as can be)."""
            if state["gone"]:
                raise Gone()
            data = json.dumps(msg).encode() + b"\n"
            pending.append(b"%x\r\n%s\r\n" % (len(data), data))

        def flush(end=b""):
            if state["gone"]:
                raise Gone()
            data = b"".join(pending) + end
            pending.clear()
            if not data:
                return
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:
                state["gone"] = True
                raise Gone()

        emit.flush = flush

        def gone():
            if not state["gone"] and self._client_gone():
                state["gone"] = True
            return state["gone"]

        try:
            ctx.execute(code, env_vars, self.headers.get("X-Access-Token"), emit, gone)
        except Gone:
            pass
        except KernelError as e:
            try:
                emit({"type": "error", "name": "KernelError", "value": str(e), "traceback": str(e)})
                emit({"type": "unexpected_end_of_execution"})
            except Gone:
                pass
        if state["gone"]:
            self.close_connection = True
            return
        try:
            flush(b"0\r\n\r\n")  # the last lines and the end of the body in one write
        except Gone:
            self.close_connection = True


# A restore (a create from the template's checkpoint, be it into the warm pool, or from a
# snapshot or a fork) brings this process and the kernels back with their memory cold: the
# first runCode after it paid some 25 ms more than the next, in page faults. A restore cannot be
# waited for, but it shows as a sleep that overran (the clocks count the time the sandbox was
# checkpointed): then every idle kernel runs a silent cell through its formatters, and the
# server's own HTTP path and envd's /envs are asked once, so that the first runCode finds them
# warm. A pool instance is restored well before its create claims it. The watch wakes every
# RESTORE_CHECK seconds; an overrun of more than RESTORE_SLACK (a host that stalled this long
# also gets a warm-up, which is harmless) is taken as a restore.
RESTORE_CHECK, RESTORE_SLACK = 2.0, 1.0
WARM_RUN = "get_ipython().display_formatter.format(2)"


def watch_restores():
    while True:
        t = time.monotonic()
        time.sleep(RESTORE_CHECK)
        if time.monotonic() - t > RESTORE_CHECK + RESTORE_SLACK:
            try:
                warm_up()
            except Exception as e:  # never fatal: the next runCode is only slower
                log("warm-up after a restore:", e)


def warm_up():
    for ctx in CONTEXTS.all():
        # A context that is running something is warm already (and is not to be kept waiting).
        if isinstance(ctx, Context) and ctx.lock.acquire(blocking=False):
            try:
                if ctx.shell is not None:
                    ctx.silent(WARM_RUN)
            finally:
                ctx.lock.release()
    for port, path in ((PORT, "/health"), (ENVD_PORT, "/envs")):
        # /envs without the sandbox's token is refused: only its path is wanted here.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", path)
            conn.getresponse().read()
        except Exception:
            pass
        finally:
            conn.close()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    server = Server(("0.0.0.0", PORT), Handler)
    log("listening on port %d" % PORT)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    t0 = time.monotonic()
    ctx = CONTEXTS.default_for("python")
    ctx.silent(WARM)
    READY.set()
    log("default python context %s ready in %.1fs" % (ctx.id, time.monotonic() - t0))
    threading.Thread(target=watch_restores, daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
