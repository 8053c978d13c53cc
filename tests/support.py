"""Test seams: a host that loads the plugin as ChatHaikuCLI does, and a real
loopback endpoint with scripted replies and faults (see HOST_CONTRACT.md)."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_SOURCE = os.path.join(ROOT, "plugins", "evaluator.py")
BENCHMARKS = os.environ.get("EVALUATOR_BENCHMARKS") or os.path.normpath(
    os.path.join(ROOT, "..", "shared", "benchmarks"))


def benchmark(name):
    """The path of a shared benchmark file; skips the test where there is none."""
    path = os.path.join(BENCHMARKS, name)
    if not os.path.isfile(path):
        import pytest
        pytest.skip("no shared benchmarks at %s (set EVALUATOR_BENCHMARKS)" % BENCHMARKS)
    return path


# ---- the host's classes -------------------------------------------------

class Plugin(object):
    name = ""
    description = ""
    commands = []

    def on_load(self, ctx):
        pass

    def on_unload(self, ctx):
        pass

    def handle(self, cmd, args, ctx):
        pass

    def help_text(self):
        return self.description


class PluginContext(object):
    pass


class Color(object):
    RESET, DIM, BOLD = "\033[0m", "\033[2m", "\033[1m"
    BLUE, CYAN, GREEN = "\033[34m", "\033[36m", "\033[32m"
    YELLOW, RED, MAGENTA, GREY = "\033[33m", "\033[31m", "\033[35m", "\033[90m"


class Sampling(object):
    FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens",
              "repetition_penalty", "no_repeat_ngram")

    def __init__(self):
        # the host's interactive "balanced" preset
        self.temperature, self.top_p, self.top_k = 0.35, 0.37, 0
        self.max_new_tokens, self.repetition_penalty, self.no_repeat_ngram = 80, 1.15, 4

    def to_payload(self):
        return {f: getattr(self, f) for f in self.FIELDS}


def routes(url):
    if url.endswith("/api/chat"):
        return url, url[:-9] + "/api/health"
    return url + "/api/chat", url + "/api/health"


class OldContext(object):
    """The context of host releases before 1.2.0: no model_name, no health."""

    def __init__(self, server_url, chat_hook=None):
        self.server_url = server_url.rstrip("/")
        self.sampling = Sampling()
        self.conversation = []
        self.printed = []
        self.chat_calls = 0
        self.chat_hook = chat_hook   # called before each request: may raise

    def chat(self, prompt, history=None, sampling_override=None):
        self.chat_calls += 1
        if self.chat_hook:
            self.chat_hook(self.chat_calls, prompt)
        payload = self.sampling.to_payload()
        payload.update(sampling_override or {})
        payload["history"] = list(history or []) + [{"role": "user", "content": prompt}]
        request = urllib.request.Request(
            routes(self.server_url)[0], data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", "User-Agent": "Mozilla/5.0"})
        try:
            with urllib.request.urlopen(request, timeout=180) as response:
                body = json.loads(response.read().decode("utf-8"))
        except Exception:
            return None
        reply = body.get("reply") if isinstance(body, dict) else None
        if not isinstance(reply, str) or not reply.strip():
            return None
        return reply

    def print(self, msg, color=""):
        self.printed.append(msg)
        print(color + msg + Color.RESET)


class NewContext(OldContext):
    """The context of host releases 1.2.0 and later."""

    def __init__(self, server_url, chat_hook=None):
        OldContext.__init__(self, server_url, chat_hook)
        self.health = None
        self.model_name = "unknown"
        self.refreshes = 0

    def refresh_health(self):
        self.refreshes += 1
        try:
            with urllib.request.urlopen(routes(self.server_url)[1], timeout=5) as response:
                body = json.loads(response.read().decode("utf-8"))
        except Exception:
            return None
        self.health = body
        self.model_name = body.get("model") or "unknown"
        return body


class Host(object):
    """Loads plugins/*.py the way ChatHaikuCLI does and dispatches lines."""

    def __init__(self, plugins_dir, context_factory):
        self.plugins_dir = plugins_dir
        self.context_factory = context_factory
        self.errors, self.plugins, self.commands, self.modules = [], [], {}, []
        self.load()

    def load(self):
        for name in sorted(os.listdir(self.plugins_dir)):
            if not name.endswith(".py") or name.startswith("_"):
                continue
            path = os.path.join(self.plugins_dir, name)
            spec = importlib.util.spec_from_file_location("haiku_plugin_" + name[:-3], path)
            module = importlib.util.module_from_spec(spec)
            module.Plugin, module.PluginContext, module.Color = Plugin, PluginContext, Color
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                self.errors.append("import failed: %s" % exc)
                continue
            self.modules.append(module)
            for attr in dir(module):
                obj = getattr(module, attr)
                if isinstance(obj, type) and issubclass(obj, Plugin) and obj is not Plugin:
                    instance = obj()
                    self.plugins.append(instance)
                    for command in instance.commands:
                        self.commands.setdefault(command, instance)
                    instance.on_load(self.context_factory())

    def reload(self):
        for plugin in self.plugins:
            plugin.on_unload(self.context_factory())
        self.plugins, self.commands = [], {}
        self.load()

    def dispatch(self, line, ctx=None):
        """Run one line; return the context used.  Like the host, survive anything."""
        parts = line.split()
        plugin = self.commands[parts[0]]
        ctx = ctx or self.context_factory()
        try:
            plugin.handle(parts[0], parts[1:], ctx)
        except KeyboardInterrupt:
            self.errors.append("[plugin %s] interrupted" % plugin.name)
        except Exception as exc:
            self.errors.append("[plugin %s] raised: %r" % (plugin.name, exc))
        return ctx


def load_module(path=PLUGIN_SOURCE):
    """The plugin module as the host builds it (injected globals, not in sys.modules)."""
    spec = importlib.util.spec_from_file_location("haiku_plugin_evaluator", path)
    module = importlib.util.module_from_spec(spec)
    module.Plugin, module.PluginContext, module.Color = Plugin, PluginContext, Color
    spec.loader.exec_module(module)
    return module


def interrupting_host(plugins, endpoint, at_call):
    """A host whose ctx.chat raises KeyboardInterrupt (Ctrl-C) on call ``at_call``."""
    def hook(n, prompt):
        if n == at_call:
            raise KeyboardInterrupt
    host = Host(str(plugins), lambda: NewContext(endpoint.url, hook))
    host.plugins_path = plugins
    return host


def install_plugin(tmp_path):
    """A fresh plugins/ folder holding a copy of the plugin; returns its path."""
    plugins = tmp_path / "plugins"
    plugins.mkdir(exist_ok=True)
    shutil.copy(PLUGIN_SOURCE, str(plugins / "evaluator.py"))
    return plugins


def add_test(plugins, name, lines):
    """Write a test file of JSON-able lines (or raw strings) into evaluator/tests."""
    folder = plugins / "evaluator" / "tests"
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines)
    (folder / name).write_text(text, encoding="utf-8")
    return folder / name


def copy_benchmark(plugins, name):
    folder = plugins / "evaluator" / "tests"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(benchmark(name), str(folder / name))


def results(plugins):
    folder = plugins / "evaluator" / "results"
    return sorted(p for p in folder.iterdir() if p.suffix == ".json") if folder.exists() else []


def read_json(path):
    with open(str(path), encoding="utf-8") as handle:
        return json.load(handle)


def journals(plugins):
    folder = plugins / "evaluator" / "results"
    return sorted(folder.glob("*.journal.jsonl"))


def start_standalone(plugins, *args, env=None, text=True, **popen_args):
    """Start the plugin file as a command, output piped; return the Popen."""
    full_env = dict(os.environ)
    full_env.pop("NO_COLOR", None)
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, str(plugins / "evaluator.py")] + list(args),
                            cwd=str(plugins.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env,
                            encoding="utf-8" if text else None, **popen_args)


def run_standalone(plugins, *args, timeout=120, **start_args):
    """Run the plugin file as a command to its end; return the CompletedProcess."""
    proc = start_standalone(plugins, *args, **start_args)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---- the loopback endpoint ----------------------------------------------

def question_of(body):
    """The question of the prompt a chat request carries."""
    return body["history"][-1]["content"].rsplit("\n\n", 2)[0]


class Reply(object):
    """What the endpoint does with one request (plain strings are replies)."""

    def __init__(self, status=200, body=None, raw=None, content_type="application/json",
                 reset=False, hang=None):
        self.status, self.body, self.raw = status, body, raw
        self.content_type, self.reset, self.hang = content_type, reset, hang


class Endpoint(object):
    """A real HTTP server on 127.0.0.1 with a scripted answer per request.

    ``script(body, n)`` gets the decoded JSON request and its 1-based number
    and returns a reply string, a Reply, or None for a mock-like letter.
    """

    def __init__(self, script=None, model="h2o8_preview_01", health=True):
        self.script = script or (lambda body, n: "A")
        self.model, self.health = model, health
        self.requests, self.headers = [], []
        self.lock = threading.Lock()
        self.release = threading.Event()   # set to end every hanging request
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.endswith("/api/health") and endpoint.health:
                    self._send(Reply(body={"model": endpoint.model, "status": "ok"}))
                else:
                    self._send(Reply(404, raw=b"<html>Not found</html>", content_type="text/html"))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length).decode("utf-8"))
                with endpoint.lock:
                    endpoint.requests.append(body)
                    endpoint.headers.append(dict(self.headers))
                    n = len(endpoint.requests)
                if not self.path.endswith("/api/chat"):
                    return self._send(Reply(404, raw=b"no such route", content_type="text/plain"))
                action = endpoint.script(body, n)
                if not isinstance(action, Reply):
                    action = Reply(body={"reply": action})
                self._send(action)

            def _send(self, action):
                if action.hang:
                    endpoint.release.wait(action.hang)
                    return
                if action.reset:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                data = action.raw if action.raw is not None else json.dumps(action.body).encode()
                self.send_response(action.status)
                self.send_header("Content-Type", action.content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def questions_asked(self):
        with self.lock:
            return [question_of(b) for b in self.requests]

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def answer_key(path):
    """{question text: answer letter} of a test file, for scripted perfect replies."""
    key = {}
    with open(path, encoding="utf-8-sig") as handle:
        for line in handle:
            obj = json.loads(line) if line.strip() else {}
            if "question" in obj:
                answer = obj["answer"]
                letter = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[answer] if isinstance(answer, int) else \
                    answer.strip("().").upper()
                key[obj["question"]] = letter
    return key


def free_port():
    """A loopback port with nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
