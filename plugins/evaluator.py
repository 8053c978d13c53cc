"""Evaluator: multiple-choice benchmarks for small chat models.

A ChatHaikuCLI plugin (``/eval run featherweight``) and, from the same file,
a command (``python evaluator.py run featherweight --server URL``).  It reads
``.jsonl`` tests, asks every question alone with deterministic sampling,
reads the model's letter out of its reply and writes one JSON result file per
run.  Standard library only; Python 3.8 or newer.
"""

import contextlib
import gc
import hashlib
import http.client
import json
import math
import os
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from urllib.parse import urlsplit

# ---- constants and templates ---------------------------------------------

VERSION = "1.0.0"

DEFAULT_PROMPT_TEMPLATE = (
    "{question}\n"
    "\n"
    "{choices_block}\n"
    "\n"
    "Answer with just the letter of the correct choice."
)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MIN_CHOICES, MAX_CHOICES = 2, len(LETTERS)
UNCATEGORISED = "uncategorized"
SUPPORTED_FORMATS = (None, "multiple_choice", "multiple-choice", "mc")

# Every flag's default lives here and only here.
DEFAULTS = {
    "limit": None,
    "temperature": 0.0,
    "max_new_tokens": 20,
    "no_save": False,
    "verbose": False,
    "resume": False,
    "retries": 2,
    "workers": 1,
    "server": "http://localhost:8000",
    "timeout": 180.0,
    "fail_under": None,
}
MAX_WORKERS = 64
MAX_RETRIES = 10

RESUME_KEYS = ("params", "prompt_template", "fingerprint")   # what a resumed journal must match
RESULT_FIELDS = (
    "test", "test_name", "model", "endpoint", "timestamp", "params",
    "prompt_template", "total", "answered", "correct", "incorrect",
    "parse_errors", "accuracy", "accuracy_parsed_only", "elapsed_seconds",
    "by_category", "interrupted", "request_errors", "stop_reason", "details",
)
DETAIL_FIELDS = (
    "id", "category", "question", "choices", "expected", "predicted",
    "correct", "raw_response",
)

EXIT_OK, EXIT_BELOW_THRESHOLD, EXIT_USAGE, EXIT_ENDPOINT = 0, 1, 2, 3
EXIT_INTERNAL, EXIT_UNSAVED, EXIT_INTERRUPTED = 70, 73, 130

MAX_REPORTED_PROBLEMS = 20   # per test file; the rest are counted
OUTAGE_AFTER = 5             # consecutive questions failing every attempt
RETRY_BACKOFF = 0.25         # seconds before the first retry; doubles after,
RETRY_BACKOFF_MAX = 2.0      # up to this
HEALTH_TIMEOUT = 5.0
RECENT_RESULTS = 20
HOST_FAILURE = "request failed"   # the host's ctx.chat gives no reason
CTRL_C = "interrupted (Ctrl-C)"
USER_AGENT = ("Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 "
              "(KHTML, like Gecko) Chrome/126.0 Safari/537.36")
PUBLIC_SITE = "chathaiku.com"

HOME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluator")

SEED_NAME = "example"
SEED_TEST = [
    {"_meta": True, "name": "Mini General Eval",
     "description": "Five quick general-knowledge questions that check "
                    "Evaluator and the endpoint work end to end."},
    {"id": "geo1", "category": "geography",
     "question": "What is the capital of France?",
     "choices": ["Berlin", "Paris", "Madrid", "Rome"], "answer": "B"},
    {"id": "math1", "category": "math", "question": "What is 7 x 8?",
     "choices": ["54", "55", "56", "63"], "answer": "C"},
    {"id": "sci1", "category": "science",
     "question": "Which planet is closest to the Sun?",
     "choices": ["Venus", "Earth", "Mercury", "Mars"], "answer": "C"},
    {"id": "lang1", "category": "language",
     "question": "Which of these words is a verb?",
     "choices": ["happy", "quickly", "run", "blue"], "answer": "C"},
    {"id": "hist1", "category": "history",
     "question": "In which year did World War II end in Europe?",
     "choices": ["1942", "1945", "1948", "1950"], "answer": "B"},
]

try:
    Plugin
except NameError:  # run as a command: the host injects these, nobody else
    class Plugin(object):
        name, description, commands = "", "", []

        def on_load(self, ctx):
            pass

        def on_unload(self, ctx):
            pass

        def help_text(self):
            return self.description

try:
    Color
except NameError:
    class Color(object):
        RESET, DIM, BOLD = "\033[0m", "\033[2m", "\033[1m"
        BLUE, CYAN, GREEN = "\033[34m", "\033[36m", "\033[32m"
        YELLOW, RED, MAGENTA, GREY = "\033[33m", "\033[31m", "\033[35m", "\033[90m"


class UsageError(Exception):
    """A command line that cannot be carried out as typed.

    ``brief`` errors point to help instead of repeating the usage.
    """

    def __init__(self, message, brief=False):
        Exception.__init__(self, message)
        self.brief = brief


# ---- loading and validating tests ----------------------------------------

_PLAIN_ANSWERS = {c: c.upper() for c in LETTERS + LETTERS.lower()}
_ONLY_STR = {str}
_ANSWER_LABEL_RE = re.compile(r"\s*(?:\(([A-Za-z])\)|([A-Za-z])[.)]?)\s*\Z")


class TestFileError(Exception):
    """A test file that cannot be used; ``problems`` has one line per reason."""

    def __init__(self, problems):
        Exception.__init__(self, problems[0])
        self.problems = problems


class TestFile(object):
    """A validated test: its name, description and normalised questions."""

    __slots__ = ("path", "file", "base", "name", "description", "questions")

    def __init__(self, path, name, description, questions):
        self.path = path
        self.file = os.path.basename(path)
        self.base = test_base(path)
        self.name = name or self.base
        self.description = description or ""
        self.questions = questions


def test_base(path_or_name):
    """The name a test's results are filed under.

    >>> test_base("tests/featherweight_v1.jsonl")
    'featherweight_v1'
    """
    name = os.path.basename(path_or_name)
    return name[:-6] if name.lower().endswith(".jsonl") else name


def load_test(path):
    """Read and validate a test file, or raise TestFileError naming every bad line."""
    try:
        with open(path, "rb") as handle, _gc_paused():
            meta, questions = parse_test(handle, os.path.basename(path))
    except OSError as exc:
        raise TestFileError(["%s: cannot read it (%s)" % (
            os.path.basename(path), exc.strerror or exc)])
    return TestFile(path, meta.get("name"), meta.get("description"), questions)


@contextlib.contextmanager
def _gc_paused():
    """Build many small dicts without the collector scanning them over and over."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_test(lines, filename):
    """Validate the lines (bytes) of a test file; return (header, questions)."""
    problems, questions, meta, meta_line = [], [], {}, 0
    first = True
    for lineno, raw in enumerate(lines, 1):
        where = "%s:%d: " % (filename, lineno)
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            problems.append(where + "not UTF-8 text (byte 0x%02x)" % raw[exc.start])
            continue
        if not line or line.isspace():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            problems.append(where + "invalid JSON (%s)" % _json_error(exc))
            first = False
            continue
        if type(obj) is not dict:
            problems.append(where + "expected a JSON object, found %s" % _describe(obj))
        elif "_meta" in obj:
            if not first:
                problems.append(where + "a _meta header is only allowed on the first line")
            else:
                meta_line = lineno
                meta, why, fatal = _check_header(obj)
                if why:
                    problems.append(where + why)
                    if fatal:
                        break
        else:
            question, why = _check_question(obj, len(questions) + 1)
            if why:
                problems.append(where + why)
            elif not problems:
                questions.append(question)
        first = False
    if not problems and not questions:
        problems.append("%s:%d: no questions%s" % (
            filename, meta_line or 1,
            " after the _meta header" if meta_line else " (the file is empty)"))
    if problems:
        raise TestFileError(_capped(problems))
    return meta, questions


def _check_header(obj):
    """Return (header, problem or None, whether the problem ends the check)."""
    meta = {}
    for key in ("name", "description"):
        value = obj.get(key)
        if value is not None and not isinstance(value, str):
            return meta, "_meta '%s' must be a string, not %s" % (key, _describe(value)), False
        meta[key] = value
    fmt = obj.get("test_format")
    if fmt not in SUPPORTED_FORMATS:
        return meta, ("test_format %s is not supported: Evaluator runs multiple-choice "
                      "tests, and these questions have no 'choices'" % _short_repr(fmt)), True
    return meta, None, False


def _check_question(obj, number):
    """Return (question, None) or (None, every reason the line is wrong)."""
    text, choices, answer = obj.get("question"), obj.get("choices"), obj.get("answer")
    qid, category = obj.get("id"), obj.get("category")
    if type(text) is str and type(choices) is list and type(answer) is str \
            and MIN_CHOICES <= len(choices) <= MAX_CHOICES and text.strip() \
            and set(map(type, choices)) == _ONLY_STR \
            and (qid is None or type(qid) is int or type(qid) is str and qid) \
            and (category is None or type(category) is str and category.strip()):
        letter = _PLAIN_ANSWERS.get(answer)
        if letter is not None and ord(letter) - 65 < len(choices):   # the common case, fast
            return _question(obj, number, letter), None
    return _check_question_fully(obj, number)


def _question(obj, number, letter):
    qid = obj.get("id")
    return {"id": str(qid) if qid is not None else "q%d" % number,
            "category": obj.get("category"), "question": obj["question"],
            "choices": obj["choices"], "answer": letter}


def _check_question_fully(obj, number):
    reasons = []
    text = obj.get("question")
    if not isinstance(text, str) or not text.strip():
        reasons.append("missing 'question'" if text is None else
                       "'question' must be a non-empty string")
    choices = obj.get("choices")
    count = None
    if choices is None:
        reasons.append("missing 'choices'")
    elif type(choices) is not list:
        reasons.append("'choices' must be a list of strings, not %s" % _describe(choices))
    elif not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
        reasons.append("'choices' has %d items; %d to %d are allowed"
                       % (len(choices), MIN_CHOICES, MAX_CHOICES))
    else:
        count = len(choices)
        for i, choice in enumerate(choices):
            if not isinstance(choice, str):
                reasons.append("choice %s is %s, not a string" % (LETTERS[i], _describe(choice)))
    answer = None
    if "answer" not in obj:
        reasons.append("missing 'answer'")
    else:
        answer, why = normalise_answer(obj["answer"], count or MAX_CHOICES)
        if why:
            reasons.append(why)
    qid = obj.get("id")
    if qid is not None and (type(qid) is not str and type(qid) is not int or qid == ""):
        reasons.append("'id' must be a non-empty string or an integer")
    category = obj.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        reasons.append("'category' must be a non-empty string")
    if reasons:
        return None, "; ".join(reasons)
    return _question(obj, number, answer), None


def normalise_answer(value, count):
    """Return (letter, None) or (None, reason) for an 'answer' value.

    >>> normalise_answer("(c)", 4)
    ('C', None)
    >>> normalise_answer(1, 4)
    ('B', None)
    """
    span = "A-%s" % LETTERS[count - 1]
    if isinstance(value, (bool, float)):
        return None, "'answer' must be a letter (%s) or a 0-based index, not %s" % (
            span, _describe(value))
    if isinstance(value, int):
        if 0 <= value < count:
            return LETTERS[value], None
        return None, "'answer' index %d is out of range (0-%d for %d choices)" % (
            value, count - 1, count)
    if isinstance(value, str):
        match = _ANSWER_LABEL_RE.match(value)
        if not match:
            return None, "'answer' %s is not a letter (%s)" % (_short_repr(value), span)
        letter = (match.group(1) or match.group(2)).upper()
        if LETTERS.index(letter) >= count:
            return None, "'answer' %s is out of range (%s for %d choices)" % (
                _short_repr(value), span, count)
        return letter, None
    return None, "'answer' must be a letter (%s) or a 0-based index, not %s" % (
        span, _describe(value))


def _describe(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean (%s)" % ("true" if value else "false")
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else "Infinity"
    if isinstance(value, (int, float)):
        return "a number (%r)" % value
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "a string"


def _short_repr(value, limit=40):
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_error(exc):
    return "%s at column %d" % (exc.msg, exc.colno) if hasattr(exc, "colno") else str(exc)


def _capped(problems):
    if len(problems) <= MAX_REPORTED_PROBLEMS:
        return problems
    extra = len(problems) - MAX_REPORTED_PROBLEMS
    return problems[:MAX_REPORTED_PROBLEMS] + ["... and %d more bad line%s" % (
        extra, "" if extra == 1 else "s")]


def select_questions(test, limit):
    """The first ``limit`` questions (all of them when limit is None)."""
    return test.questions if limit is None else test.questions[:limit]


# ---- building prompts -----------------------------------------------------

def choices_block(choices):
    """The lettered choice lines of a prompt.

    >>> print(choices_block(["Paris", "Rome"]))
    A) Paris
    B) Rome
    """
    return "\n".join("%s) %s" % (LETTERS[i], c) for i, c in enumerate(choices))


def build_prompt(question, template=DEFAULT_PROMPT_TEMPLATE):
    return template.format(question=question["question"],
                           choices_block=choices_block(question["choices"]))


def sampling_override(temperature, max_new_tokens):
    """The sampling sent with every request: greedy unless a temperature is set."""
    return {"temperature": temperature, "top_p": 1.0,
            "top_k": 1 if temperature == 0 else 0,
            "max_new_tokens": max_new_tokens, "repetition_penalty": 1.0,
            "no_repeat_ngram": 0}


def fingerprint(questions):
    """A short digest of a test's questions: a journal resumes only the same test."""
    return hashlib.sha256(json.dumps(questions, sort_keys=True).encode(
        "utf-8", "surrogatepass")).hexdigest()[:16]


def run_params(opts):
    """What decides a run's answers, recorded in its result and its journal."""
    params = sampling_override(opts["temperature"], opts["max_new_tokens"])
    params["limit"] = opts["limit"]
    return params


# ---- talking to the endpoint ----------------------------------------------

_PRIVATE_HOST_RE = re.compile(
    r"(localhost|127\.\d+\.\d+\.\d+|10\.\d+\.\d+\.\d+|192\.168\.\d+\.\d+"
    r"|172\.(1[6-9]|2\d|3[01])\.\d+\.\d+)\Z", re.I)


def resolve_routes(url):
    """Return (chat_url, health_url) for a URL as a user types it.

    >>> resolve_routes("localhost:8000")
    ('http://localhost:8000/api/chat', 'http://localhost:8000/api/health')
    >>> resolve_routes("https://example.org/api/haiku.php")[0]
    'https://example.org/api/haiku.php/api/chat'
    """
    url = (url or "").strip()
    if not url:
        raise ValueError("no endpoint URL given")
    if "://" not in url:
        host = url.split("/", 1)[0].rsplit(":", 1)[0]
        url = ("http://" if _PRIVATE_HOST_RE.match(host) else "https://") + url
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("endpoint %s: only http and https are supported" % url)
    try:
        if not parts.hostname or parts.port == 0:
            raise ValueError
    except ValueError:
        raise ValueError("endpoint %s has no host name or a bad port" % url)
    if url.endswith("/api/chat"):
        return url, url[:-len("/api/chat")] + "/api/health"
    if url.endswith("/api/health"):
        return url[:-len("/api/health")] + "/api/chat", url
    return url + "/api/chat", url + "/api/health"


def _request_headers(url, with_body):
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if with_body:
        headers["Content-Type"] = "application/json"
    host = (urlsplit(url).hostname or "").lower()
    if host == PUBLIC_SITE or host.endswith("." + PUBLIC_SITE):
        headers["Origin"] = "https://" + PUBLIC_SITE
        headers["Referer"] = "https://" + PUBLIC_SITE + "/"
    return headers


def http_json(url, body=None, timeout=DEFAULTS["timeout"]):
    """GET (or POST ``body``) and return (decoded JSON, None) or (None, why it failed)."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data,
                                     headers=_request_headers(url, data is not None))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        return None, ("HTTP %d %s" % (exc.code, exc.reason or "")).strip() + _error_detail(exc)
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, OSError) and "timed out" in str(reason):
            return None, "timed out after %gs" % timeout
        return None, "network error: %s" % (getattr(reason, "strerror", None) or reason)
    except (OSError, ValueError, http.client.HTTPException) as exc:   # timeouts, resets
        if "timed out" in str(exc):
            return None, "timed out after %gs" % timeout
        return None, "network error: %s" % (str(exc) or exc.__class__.__name__)
    try:
        return json.loads(raw.decode("utf-8")), None
    except ValueError:
        return None, "response is not JSON"


def _error_detail(response):
    """": message" when an error response says {"error": message}, else ""."""
    with contextlib.suppress(Exception):
        error = json.loads(response.read(4096).decode("utf-8")).get("error")
        if error:
            return ": %s" % error
    return ""


def reply_from_body(body):
    """Return (reply, None) or (None, reason) for a decoded chat response."""
    if not isinstance(body, dict):
        return None, "response is not a JSON object"
    reply = body.get("reply")
    if reply is None:
        error = body.get("error")
        return None, ("server error: %s" % error) if error is not None else "no 'reply' in response"
    if not isinstance(reply, str):
        return None, "reply is not a string"
    if not reply.strip():
        return None, "empty reply"
    return reply, None


class HttpEndpoint(object):
    """A Rootcomputer-compatible server reached directly (the standalone command)."""

    def __init__(self, url, timeout):
        self.chat_url, self.health_url = resolve_routes(url)
        self.label = self.chat_url[:-len("/api/chat")]
        self.timeout = timeout

    def asker(self, override):
        def ask(prompt):
            body = dict(override, history=[{"role": "user", "content": prompt}])
            decoded, why = http_json(self.chat_url, body, self.timeout)
            return (None, why) if why else reply_from_body(decoded)
        return ask

    def model_name(self):
        return health_model(self.health_url)


class HostEndpoint(object):
    """The endpoint of the running ChatHaikuCLI, reached through ``ctx.chat``."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.label = str(getattr(ctx, "server_url", "") or "unknown")

    def asker(self, override):
        chat = self.ctx.chat

        def ask(prompt):
            reply = chat(prompt, history=[], sampling_override=dict(override))
            if isinstance(reply, str) and reply.strip():
                return reply, None
            return None, HOST_FAILURE
        return ask

    def model_name(self):
        """``ctx.model_name`` on hosts that have it, else the health route."""
        ctx = self.ctx
        with contextlib.suppress(Exception):
            if hasattr(ctx, "model_name"):
                if ctx.model_name in (None, "", "unknown") and hasattr(ctx, "refresh_health"):
                    ctx.refresh_health()
                name = ctx.model_name
                return name if isinstance(name, str) and name else "unknown"
            return health_model(resolve_routes(self.label)[1])
        return "unknown"


class MockEndpoint(object):
    """An offline stand-in that answers from a hash of the prompt, at about chance."""

    label = "mock"
    _STYLES = ("{L}", "The answer is {L}.", "({L})", "{L}) {text}")
    _CHOICE_LINE_RE = re.compile(r"^([A-Z])\) (.*)$", re.M)

    def asker(self, override):
        def ask(prompt):
            digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()
            options = self._CHOICE_LINE_RE.findall(prompt) or [("A", "")]
            letter, text = options[digest[0] % len(options)]
            return self._STYLES[digest[1] % len(self._STYLES)].format(L=letter, text=text), None
        return ask

    def model_name(self):
        return "mock"


def health_model(health_url):
    """The ``model`` a health route reports, or "unknown"."""
    body, why = http_json(health_url, timeout=HEALTH_TIMEOUT)
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model.strip() else "unknown"


# ---- reading answers ------------------------------------------------------

_PAREN_LETTER_RE = re.compile(r"(?<![^\W_])\(([A-Za-z])\)")
_ANSWER_PHRASE_RE = re.compile(
    r"\b(?:answer|option|choice|letter)\b(?:\s+(?:is|would\s+be|should\s+be|will\s+be|must\s+be)\b)?"
    r"[\s:*=\-\"'`\u201c\u2018]*\(?([A-Za-z])(?![^\W_])", re.I)
_LEADING_LETTER_RE = re.compile(r"[^\w(]*\(?([A-Za-z])(?![^\W_])")
_STANDALONE_RE = re.compile(r"(?<![^\W_])([A-Z])(?![^\W_])")
_LABEL_TOKEN_RE = re.compile(r"(?<![^\W_])[(\[]?[A-Za-z][).:\]]")
_NEXT_WORD_RE = re.compile(r"\s+([a-z]+)")
_LISTING_GAP_RE = re.compile(r"[\s,;|/*\-]*\Z")
_HAS_WORD_RE = re.compile(r"[^\W_]")
_NEGATION_RE = re.compile(
    r"(?:\bnot|n['\u2019]t|\bnever)\s+(?:(?:the\s+)?(?:option|choice|answer)\s+)?\(?\Z", re.I)
_JOINERS = "'\u2019-"
_SPACED_WORD_CHAR_RE = re.compile(
    "[^\\W_\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_TERMINAL_CODES_RE = re.compile(
    "(?:\x1b\\[|\x9b)[0-?]*[ -/]*[@-~]|\x1b\\][^\x07\x1b\x9c]*(?:\x07|\x1b\\\\|\x9c)?"
    "|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# After a lone "I" these words make it a choice label ("I is correct"), not
# the pronoun ("I think"); after "a"/"A" also modals and small words do.
_AFTER_LABEL_I = frozenset(
    "is was seems looks appears sounds fits matches and or nor because since "
    "corresponds refers means stands wins works remains makes gives of for "
    "from than which that instead".split())
_AFTER_LABEL_A = _AFTER_LABEL_I | frozenset(
    "would will could should might must may can has had but so then also too "
    "as to in on with by if though here there not only".split())
_INSTRUCTION = DEFAULT_PROMPT_TEMPLATE.rsplit("\n", 1)[-1]


def _phrase_pattern(text):
    """A regex for ``text`` with flexible white space and word edges.

    An edge that is a letter or digit must not touch another one, so "194"
    is not found in "1945"; scripts written without spaces (Chinese,
    Japanese, Thai) have no such edges.
    """
    words = text.split()
    if not words:
        return None
    body = r"\s+".join(re.escape(w) for w in words)
    head = r"(?<![^\W_])" if _SPACED_WORD_CHAR_RE.match(words[0]) else ""
    tail = r"(?![^\W_])" if _SPACED_WORD_CHAR_RE.match(words[-1][-1]) else ""
    return head + body + tail


_INSTRUCTION_RE = re.compile(_phrase_pattern(_INSTRUCTION), re.I)


def read_answer(reply, choices, question="", prompt=""):
    """The letter a reply picks among ``choices``, or None when it picks none.

    The documented cascade, in order: (1) "(B)"; (2) "Answer: B", "answer is
    B" or "option B"; (3) a reply starting with a letter ("B)", "B."); (4) a
    choice's text, earliest mention first; (5) any standalone capital letter;
    (6) the first non-blank character.  Echoed prompt text is ignored, and a
    letter that is a word of prose (the article "a", the pronoun "I", "I'd")
    or follows "not" never counts.

    >>> read_answer("The answer is (C).", ["54", "55", "56", "63"])
    'C'
    >>> read_answer("A planet named Mercury", ["Venus", "Earth", "Mercury", "Mars"])
    'C'
    >>> read_answer("I'd go with B", ["x", "y", "z", "w"])
    'B'
    """
    valid = LETTERS[:len(choices)]
    text = _without_echo(_TERMINAL_CODES_RE.sub(" ", reply), choices, question, prompt)
    if not _HAS_WORD_RE.search(text):
        return None
    for step in (_by_paren_letter, _by_answer_phrase, _by_leading_letter,
                 _by_choice_text, _by_standalone_letter, _by_first_character):
        letter = step(text, valid, choices)
        if letter:
            return letter
    return None


def _first_label(matches, text, valid, check_prose=True):
    for match in matches:
        letter, start = match.group(1).upper(), match.start(1)
        if letter in valid and not _is_negated(text, match.start()) \
                and not (check_prose and _is_prose(text, start)):
            return letter
    return None


def _is_negated(text, start):
    """True after "not", "n't" or "never": "not A, but B" picks B."""
    return bool(_NEGATION_RE.search(text, max(0, start - 30), start))


def _by_paren_letter(text, valid, choices):
    return _first_label(_PAREN_LETTER_RE.finditer(text), text, valid, check_prose=False)


def _by_answer_phrase(text, valid, choices):
    return _first_label(_ANSWER_PHRASE_RE.finditer(text), text, valid)


def _by_leading_letter(text, valid, choices):
    match = _LEADING_LETTER_RE.match(text)
    return _first_label([match], text, valid) if match else None


def _by_choice_text(text, valid, choices):
    best = None
    for i, choice in enumerate(choices):
        pattern = _phrase_pattern(choice)
        matches = re.finditer(pattern, text, re.I) if pattern else ()
        match = next((m for m in matches if not _is_negated(text, m.start())), None)
        if match:
            key = (match.start(), -(match.end() - match.start()))
            if best is None or key < best[0]:
                best = (key, LETTERS[i])
    return best[1] if best else None


def _by_standalone_letter(text, valid, choices):
    return _first_label(_STANDALONE_RE.finditer(text), text, valid)


def _by_first_character(text, valid, choices):
    stripped = text.lstrip()
    start = len(text) - len(stripped)
    letter = stripped[:1].upper()
    if not letter or letter not in valid or stripped[1:2].isalpha():
        return None
    return None if _is_prose(text, start) else letter


def _is_prose(text, start):
    """True when the lone letter at ``text[start]`` is a word, not a label.

    Contractions and compounds ("I'd", "it's", "T-shirt"), abbreviations
    ("e.g."), the article "a" and the pronoun "I" before a lower-case word.
    """
    after = text[start + 1:start + 3]
    before = text[max(0, start - 2):start]
    if len(after) == 2 and after[0] in _JOINERS and after[1].isalpha():
        return True
    if len(before) == 2 and before[1] in _JOINERS and before[0].isalpha():
        return True
    if after[:1] == "." and after[1:2].isalpha() and not text[start + 3:start + 4].isalpha():
        return True
    if before[1:] == "." and before[:1].isalpha() and not text[max(0, start - 3):start - 2].isalpha():
        return True
    letter = text[start]
    if letter in "aAiI":
        follow = _NEXT_WORD_RE.match(text, start + 1)
        labels = _AFTER_LABEL_A if letter in "aA" else _AFTER_LABEL_I
        return bool(follow) and follow.group(1) not in labels
    return False


def _without_echo(reply, choices, question, prompt):
    """The reply minus any echo of the prompt, its question, instruction or option list."""
    text = reply[_echo_end(reply, prompt, question):] if prompt else reply
    if len(question.strip()) >= 12:
        text = re.sub(_phrase_pattern(question), " ", text, flags=re.I)
    text = _INSTRUCTION_RE.sub(" ", text)
    return _without_listing(text, choices)


def _echo_end(reply, prompt, question):
    """Where an echo of the prompt's opening ends in ``reply`` (0: no echo).

    White space is compared loosely and case is ignored; an echo must cover
    the question's first 12 characters (or all of a shorter one) to count.
    """
    i = j = gap = 0
    n, m = len(reply), len(prompt)
    while i < n and j < m:
        a, b = reply[i], prompt[j]
        if a.isspace() and b.isspace():
            while i < n and reply[i].isspace():
                i += 1
            while j < m and prompt[j].isspace():
                j += 1
            gap = i
            continue
        if a != b and a.lower() != b.lower():
            break
        i += 1
        j += 1
    if i < n and j < m and i and reply[i - 1].isalnum() and reply[i].isalnum():
        i = gap
    return i if i > 0 and i >= min(12, len(question.strip()) or 12) else 0


def _without_listing(text, choices):
    """Drop options listed back in order from the first ("A) x B) y ...")."""
    if len(_LABEL_TOKEN_RE.findall(text)) < 2:
        return text
    items = []
    for i, choice in enumerate(choices):
        body = _phrase_pattern(choice) or ""
        pattern = r"(?<![^\W_])[(\[]?%s[).:\]]\s*%s" % (LETTERS[i], body)
        items.extend((m.start(), m.end(), i) for m in re.finditer(pattern, text, re.I))
    items.sort()
    cuts, run = [], []
    for item in items + [None]:
        if item and run and item[2] == run[-1][2] + 1 and item[0] >= run[-1][1] \
                and _LISTING_GAP_RE.match(text, run[-1][1], item[0]):
            run.append(item)
            continue
        if len(run) >= 2 and run[0][2] == 0:
            end = _truncated_item_end(text, run[-1], choices)
            cuts.append((run[0][0], end))
        run = [item] if item else []
    for start, end in reversed(cuts):
        text = text[:start] + " " + text[end:]
    return text


def _truncated_item_end(text, last, choices):
    """Extend a listing over a final option cut short by the token limit."""
    nxt = last[2] + 1
    if nxt >= len(choices):
        return last[1]
    tail = re.match(r"[\s,;]*[(\[]?%s[).:\]]\s*(.*)\Z" % LETTERS[nxt], text[last[1]:], re.I | re.S)
    if tail and choices[nxt].lower().startswith(tail.group(1).strip().lower()):
        return len(text)
    return last[1]


# ---- running a test --------------------------------------------------------

def ask_with_retries(ask, prompt, retries, stop):
    """Return (reply, None) or (None, reason of the last failed attempt)."""
    reason = HOST_FAILURE
    for attempt in range(retries + 1):
        if attempt and stop.wait(min(RETRY_BACKOFF * 2 ** (attempt - 1), RETRY_BACKOFF_MAX)):
            break
        try:
            reply, reason = ask(prompt)
        except Exception as exc:   # a transport bug is a failed request, not a crash
            reply, reason = None, "%s: %s" % (exc.__class__.__name__, exc)
        if reply is not None:
            return reply, None
    return None, reason


class Dispatcher(object):
    """Keeps up to ``workers`` questions in flight and hands back answers as they come.

    A worker turns each reply into a result with ``settle``, hands it over,
    then passes it to ``keep`` (the journal) before it takes the next
    question, so a killed process loses only what was in flight.
    Dispatching stops once OUTAGE_AFTER questions in a row (in the order they
    finish) failed every attempt.  Worker threads are daemons: on Ctrl-C the
    caller stops dispatching and returns at once, leaving slow requests to
    finish (and be dropped) alone.
    """

    _DONE = object()

    def __init__(self, jobs, ask, settle, keep, workers, retries):
        self.stop = threading.Event()
        self._jobs = iter(jobs)
        self._lock = threading.Lock()
        self._answers = queue.Queue()
        self._ask, self._settle, self._keep, self._retries = ask, settle, keep, retries
        self.failing = []    # (key, reason) of the questions failing in a row
        self._live = max(1, min(workers, len(jobs)))
        for _ in range(self._live):
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        try:
            while not self.stop.is_set():
                with self._lock:
                    job = next(self._jobs, None)
                if job is None:
                    break
                reply, reason = ask_with_retries(self._ask, job[1], self._retries, self.stop)
                with self._lock:
                    if reply is None:
                        self.failing.append((job[0], reason))
                    else:
                        del self.failing[:]
                    if len(self.failing) >= OUTAGE_AFTER:
                        self.stop.set()
                settled = self._settle(job[0], reply, reason)
                self._answers.put((job[0], settled))
                self._keep(job[0], settled)
        except BaseException as exc:  # KeyboardInterrupt raised inside a transport, or a bug
            self.stop.set()
            self._answers.put(exc)
        finally:
            self._answers.put(self._DONE)

    def answers(self):
        """Yield (key, settled answer) until every worker is done."""
        while self._live:
            item = self._answers.get()
            if item is self._DONE:
                self._live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def received(self):
        """Answers that arrived but were not yet taken: kept after a Ctrl-C."""
        self.stop.set()
        while True:
            try:
                item = self._answers.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                yield item


def score_answer(question, reply, reason, prompt):
    """The ``details`` entry of one question."""
    predicted = None if reply is None else read_answer(
        reply, question["choices"], question["question"], prompt)
    values = dict(question, expected=question["answer"], predicted=predicted,
                  correct=predicted == question["answer"], raw_response=reply)
    detail = {field: values[field] for field in DETAIL_FIELDS}
    if reply is None:
        detail["error"] = reason
    return detail


def summarise(details):
    """Counts and accuracies over the answered questions of ``details``.

    A question whose request failed for good carries "error" and is left out.
    """
    scored = [d for d in details if "error" not in d]
    total = len(scored)
    answered = sum(1 for d in scored if d["predicted"] is not None)
    correct = sum(1 for d in scored if d["correct"])
    by_category = {}
    for d in scored:
        entry = by_category.setdefault(d["category"] or UNCATEGORISED,
                                       {"total": 0, "correct": 0, "accuracy": 0.0})
        entry["total"] += 1
        entry["correct"] += d["correct"]
    for entry in by_category.values():
        entry["accuracy"] = _ratio(entry["correct"], entry["total"])
    return {"total": total, "answered": answered, "correct": correct,
            "incorrect": answered - correct, "parse_errors": total - answered,
            "accuracy": _ratio(correct, total),
            "accuracy_parsed_only": _ratio(correct, answered),
            "by_category": by_category,
            "request_errors": len(details) - total}


def _ratio(part, whole):
    return part / whole if whole else 0.0


def build_result(run, details, elapsed, stop_reason):
    """The result file's content, in RESULT_FIELDS order."""
    counts = summarise(details)
    values = dict(counts, details=details, elapsed_seconds=round(elapsed, 3),
                  interrupted=stop_reason is not None, stop_reason=stop_reason,
                  **{k: run[k] for k in ("test", "test_name", "model", "endpoint",
                                         "timestamp", "params", "prompt_template")})
    return {field: values[field] for field in RESULT_FIELDS}


class Run(object):
    """One test being asked: the questions, what is already known, the outcome."""

    def __init__(self, info, questions, known):
        self.info = info               # the fixed fields of the result
        self.questions = questions
        self.details = dict(known)     # index -> detail, from a resumed journal
        self.stop_reason = None
        self.elapsed = 0.0

    def pending(self, template):
        return [(i, build_prompt(q, template)) for i, q in enumerate(self.questions)
                if i not in self.details or "error" in self.details[i]]

    def ordered_details(self):
        return [self.details[i] for i in sorted(self.details)]

    def result(self):
        return build_result(self.info, self.ordered_details(), self.elapsed, self.stop_reason)


def execute_run(run, ask, opts, journal, progress):
    """Ask every pending question; record each answer as it arrives.

    Stops early on Ctrl-C or when the endpoint is failing (every question
    failed, or OUTAGE_AFTER in a row); either way ``run.stop_reason`` says why.
    """
    template = run.info["prompt_template"]
    jobs = run.pending(template)
    prompts = dict(jobs)
    started = time.monotonic()

    def settle(index, reply, reason):     # in a worker thread
        return score_answer(run.questions[index], reply, reason, prompts[index])

    def record(index, detail):
        run.details[index] = detail
        progress.answered(detail, time.monotonic() - started)

    dispatcher = Dispatcher(jobs, ask, settle, journal.append, opts["workers"], opts["retries"])
    try:
        for index, detail in dispatcher.answers():
            record(index, detail)
    except KeyboardInterrupt:
        run.stop_reason = CTRL_C
    except Exception as exc:   # a bug must not cost the answers already paid for
        run.stop_reason = "internal error: %s: %s" % (exc.__class__.__name__, exc)
    finally:
        for index, detail in dispatcher.received():   # arrived: keep them
            record(index, detail)
        run.elapsed = time.monotonic() - started
        progress.finish()
    failing = dispatcher.failing
    if run.stop_reason is None and failing and (
            len(failing) >= OUTAGE_AFTER or len(failing) == len(jobs)):
        first = run.questions[min(i for i, _ in failing)]["id"]
        run.stop_reason = "endpoint failing since question %s: %s" % (first, failing[-1][1])


# ---- saving and reading results ----------------------------------------------

def _stamp():
    return datetime.now().strftime("%Y%m%dT%H%M%S")


def _now_iso():
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _encode_json(value, indent=2):
    try:
        return json.dumps(value, indent=indent, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:   # lone surrogates from a hostile reply
        return json.dumps(value, indent=indent).encode("ascii")


def write_new_file(directory, stem, suffix, data):
    """Write ``data`` atomically under a name that does not exist yet; return the path.

    The bytes go to a temporary file first and are linked into place, so a
    crash leaves either no file or a whole one, and nothing is overwritten:
    a taken name gets "_2", "_3", ... appended.
    """
    tmp = os.path.join(directory, ".%s.%s.tmp" % (stem, os.urandom(6).hex()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask decides
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        number = 1
        while True:
            path = os.path.join(directory, stem + ("_%d" % number if number > 1 else "") + suffix)
            try:
                os.link(tmp, path)
                break
            except FileExistsError:
                number += 1
            except OSError:    # a file system without hard links
                if not os.path.exists(path):
                    os.replace(tmp, path)
                    break
                number += 1
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _sync_directory(directory)
    return path


def _sync_directory(directory):
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _sigint(handler):
    """Handle Ctrl-C with ``handler`` for a while (a no-op off the main thread)."""
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None
                      else signal.default_int_handler)


def _raise_once(pressed):
    def handler(signum, frame):
        if not pressed:
            pressed.append(signum)
            raise KeyboardInterrupt
    return handler


def interrupt_once():
    """The first Ctrl-C raises KeyboardInterrupt; later ones are held back, so
    the partial result is saved whole however often the key is pressed."""
    return _sigint(_raise_once([]))


def sigint_deferred():
    """Hold off Ctrl-C while a file is being written."""
    return _sigint(lambda *_: None)


def save_result(result, results_dir, stamp):
    """Save a result file; return its path."""
    with sigint_deferred():
        return write_new_file(results_dir, "%s_%s" % (result["test"], stamp), ".json",
                              _encode_json(result))


_SYNC = getattr(os, "fdatasync", os.fsync)


class Journal(object):
    """An append-only record of a run, one flushed JSON line per finished question.

    Written next to the results so a killed run can be resumed; removed once
    the complete result is saved.  A journal that cannot be written warns
    once and the run goes on.
    """

    SUFFIX = ".journal.jsonl"

    def __init__(self, path=None, warn=None):
        self.path = path
        self._handle = None
        self._warn = warn
        self._lock = threading.Lock()    # workers append concurrently
        if path:
            try:
                self._handle = _open_for_append(path)
            except OSError as exc:
                self._stopped(exc)

    @classmethod
    def start(cls, results_dir, header, stamp, warn):
        """A new journal whose first line is ``header``."""
        line = _encode_json(header, indent=None) + b"\n"
        try:
            path = write_new_file(results_dir, "%s_%s" % (header["test"], stamp), cls.SUFFIX, line)
        except OSError as exc:
            warn("cannot write a journal in %s (%s): answers are kept in memory only"
                 % (results_dir, exc.strerror or exc))
            return cls()
        return cls(path, warn)

    def append(self, index, detail):
        line = _encode_json({"index": index, "detail": detail}, indent=None) + b"\n"
        with self._lock:
            if self._handle is None:
                return
            try:
                self._handle.write(line)
                self._handle.flush()
                _SYNC(self._handle.fileno())
                return
            except OSError as exc:   # a full disk, say
                error = exc
                self._close_handle()
        self._stopped(error)

    def _stopped(self, exc):
        if self._warn:
            self._warn("journal %s stopped (%s): later answers are kept in memory only"
                       % (self.path, getattr(exc, "strerror", None) or exc))

    def close(self):
        with self._lock:
            self._close_handle()

    def _close_handle(self):
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.close()
            self._handle = None

    def remove(self):
        self.close()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _open_for_append(path):
    """Open a journal to add lines, first cutting a half-written last line."""
    handle = open(path, "r+b")
    data = handle.read()
    if data and not data.endswith(b"\n"):
        handle.seek(data.rfind(b"\n") + 1)
        handle.truncate()
    handle.seek(0, os.SEEK_END)
    return handle


def read_journal(path):
    """Return (header, {index: detail}) from a journal, skipping a torn last line."""
    with open(path, "rb") as handle:
        lines = handle.read().split(b"\n")
    entries = []
    for raw in lines:
        try:
            entries.append(json.loads(raw.decode("utf-8")))
        except ValueError:
            continue
    if not entries or not isinstance(entries[0], dict) or "params" not in entries[0]:
        raise ValueError("not an Evaluator journal")
    known = {}
    for entry in entries[1:]:
        if isinstance(entry, dict) and isinstance(entry.get("index"), int) \
                and isinstance(entry.get("detail"), dict):
            known[entry["index"]] = entry["detail"]
    return entries[0], known


def unfinished_runs(results_dir, base):
    """Journals of ``base`` in ``results_dir``, newest first: [(path, header, known)]."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(results_dir):
            if name.startswith(base + "_") and name.endswith(Journal.SUFFIX):
                path = os.path.join(results_dir, name)
                with contextlib.suppress(OSError, ValueError):
                    header, known = read_journal(path)
                    if header.get("test") == base:
                        found.append((os.path.getmtime(path), path, header, known))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [item[1:] for item in found]


def read_result(path):
    """Return (result, None) or (None, why it cannot be shown)."""
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except OSError as exc:
        return None, "cannot read it (%s)" % (exc.strerror or exc)
    except ValueError:
        return None, "not valid JSON"
    if not isinstance(data, dict) or not isinstance(data.get("test"), str):
        return None, "not an Evaluator result"
    for field in ("total", "correct", "answered"):
        if type(data.get(field)) is not int:
            return None, "field '%s' is missing or not a whole number" % field
    if not isinstance(data.get("accuracy"), (int, float)) or isinstance(data.get("accuracy"), bool):
        return None, "field 'accuracy' is missing or not a number"
    return data, None


def result_files(results_dir):
    """Result file paths, newest first."""
    try:
        names = [n for n in os.listdir(results_dir)
                 if n.endswith(".json") and not n.startswith(".")]
    except OSError:
        return []
    paths = [os.path.join(results_dir, n) for n in names]
    stamped = []
    for path in paths:
        with contextlib.suppress(OSError):
            stamped.append((os.path.getmtime(path), path))
    stamped.sort(reverse=True)
    return [path for _, path in stamped]


class Workspace(object):
    """The evaluator folder beside the plugin: tests/ and results/."""

    def __init__(self, home=HOME):
        self.home = home
        self.tests_dir = os.path.join(home, "tests")
        self.results_dir = os.path.join(home, "results")

    def prepare(self):
        """Create the folders and seed the example test; return warnings."""
        try:
            for folder in (self.tests_dir, self.results_dir):
                os.makedirs(folder, exist_ok=True)
            if not self.test_paths():
                write_new_file(self.tests_dir, SEED_NAME, ".jsonl", "".join(
                    json.dumps(line) + "\n" for line in SEED_TEST).encode("utf-8"))
        except OSError as exc:
            return ["cannot prepare %s (%s); tests and results may be unavailable"
                    % (self.home, exc.strerror or exc)]
        return []

    def test_paths(self):
        try:
            names = sorted(n for n in os.listdir(self.tests_dir)
                           if n.lower().endswith(".jsonl") and not n.startswith("."))
        except OSError:
            return []
        return [os.path.join(self.tests_dir, n) for n in names]

    def find_test(self, name):
        """The path for "foo", "foo.jsonl" or a path to a .jsonl file."""
        if os.sep in name or (os.altsep and os.altsep in name):
            return name
        if not name.lower().endswith(".jsonl"):
            name += ".jsonl"
        return os.path.join(self.tests_dir, name)


# ---- printing ----------------------------------------------------------------

_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\x1b"}


def clean(text):
    """Text from a model or a test file, safe to show: control codes escaped.

    >>> clean("\\x1b]0;pwned\\x07ok")
    '\\\\x1b]0;pwned\\\\x07ok'
    """
    return _UNSAFE_RE.sub(lambda m: _ESCAPES.get(m.group()) or (
        "\\x%02x" % ord(m.group()) if ord(m.group()) < 0x100 else "\\u%04x" % ord(m.group())),
        str(text))


def preview(text, width=60):
    text = clean(" ".join(str(text).split()))
    return text if len(text) <= width else text[:width - 3] + "..."


def percent(ratio):
    return "%.1f%%" % (100.0 * ratio)


def duration(seconds):
    """A short human duration: 42s, 3m07s, 1h02m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return "%ds" % seconds
    if seconds < 3600:
        return "%dm%02ds" % divmod(seconds, 60)
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


def is_tty(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Terminal(object):
    """Where output goes: colour and rolling lines only on a TTY."""

    def __init__(self, stream, palette=Color):
        self.stream = stream
        self.tty = is_tty(stream)
        self.colour = self.tty and not os.environ.get("NO_COLOR")
        self.palette = palette
        self._rolling = False

    def paint(self, name):
        return getattr(self.palette, name, "") if self.colour else ""

    def line(self, text="", colour=""):
        self.end_rolling()
        reset = self.paint("RESET") if colour else ""
        self._write((self.paint(colour) if colour else "") + text + reset + "\n")

    def rolling(self, text):
        """Overwrite the current line (TTY only)."""
        self._write("\r" + text + "\033[K")
        self._rolling = True

    def end_rolling(self):
        if self._rolling:
            self._rolling = False
            self._write("\n")

    def _write(self, text):
        """Write, never failing: a reader that went away (``| head``) must not stop a run."""
        if self.stream is None:
            return
        try:
            try:
                self.stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
            self.stream.flush()
        except (OSError, ValueError):
            self.stream = None


class Progress(object):
    """Shows a run as it goes: one line per question, a rolling line, or a line now and then."""

    MARKS = {True: ("right", "GREEN"), False: ("wrong", "RED"), None: ("no answer", "YELLOW")}

    def __init__(self, term, total, verbose, known=()):
        self.term, self.total, self.verbose = term, total, verbose
        scored = [d for d in known if "error" not in d]
        self.done, self.correct = len(scored), sum(d["correct"] for d in scored)
        self.asked = 0
        self.every = max(10, -(-total // 10))   # a pipe gets at most ten lines

    def answered(self, detail, elapsed):
        self.done += 1
        self.asked += 1
        self.correct += "error" not in detail and detail["correct"]
        if self.verbose:
            self._question_line(detail)
        elif self.term.tty:
            self.term.rolling(self._status(elapsed))
        elif self.done % self.every == 0 or self.done == self.total:
            self.term.line(self._status(elapsed))

    def _question_line(self, detail):
        if "error" in detail:
            mark, colour = "failed", "MAGENTA"
            got = "(%s)" % clean(detail["error"])
        else:
            outcome = detail["correct"] if detail["predicted"] else None
            mark, colour = self.MARKS[outcome]
            got = detail["predicted"] or "-"
        self.term.line("  %-9s %-12s expected %s, got %-3s %s" % (
            mark, preview(detail["id"], 12), detail["expected"], got,
            preview(detail["question"], 50)), colour)

    def _status(self, elapsed):
        rate = self.asked / elapsed if elapsed > 0 else 0.0
        eta = duration((self.total - self.done) / rate) if rate else "?"
        return "  %d/%d done, %d correct (%s), %.1f q/s, ETA %s" % (
            self.done, self.total, self.correct, percent(_ratio(self.correct, self.done)),
            rate, eta)

    def finish(self):
        self.term.end_rolling()


def summary_lines(result):
    """The lines that report a result, shared by ``run`` and ``results <test>``."""
    lines = [("Score: %d/%d (%s)" % (result["correct"], result["total"],
                                     percent(result["accuracy"])), "BOLD"),
             ("  parse errors: %d, accuracy on parsed answers %s (%d/%d)" % (
                 result["parse_errors"], percent(result.get("accuracy_parsed_only") or 0.0),
                 result["correct"], result["answered"]), "")]
    if result.get("request_errors"):
        lines.append(("  request errors: %d (not scored)" % result["request_errors"], "MAGENTA"))
    categories = result.get("by_category")
    if isinstance(categories, dict) and len(categories) > 1:
        lines.append(("  by category:", ""))
        width = max(len(clean(c)) for c in categories)
        for name, entry in categories.items():
            with contextlib.suppress(Exception):
                lines.append(("    %-*s %4d/%-4d %s" % (width, clean(name), entry["correct"],
                                                     entry["total"], percent(entry["accuracy"])), ""))
    if result.get("interrupted"):
        lines.append(("  stopped early: %s" % clean(result.get("stop_reason") or "interrupted"),
                      "YELLOW"))
    return lines


def header_lines(test, model, endpoint, count, opts):
    params = run_params(opts)
    return [("%s (%s)" % (clean(test.name), clean(test.file)), "BOLD"),
            ("  model %s at %s, %d question%s" % (clean(model), clean(endpoint), count,
                                                   "" if count == 1 else "s"), ""),
            ("  sampling: temperature %g, top_k %d, max_new_tokens %d; workers %d" % (
                params["temperature"], params["top_k"], params["max_new_tokens"],
                opts["workers"]), "GREY")]


# ---- commands (shared by the plugin and the command line) ------------------

SUBCOMMANDS = {   # name: (positional arguments, usage)
    "help": ((0, 0), ""),
    "list": ((0, 0), ""),
    "info": ((1, 1), "<test>"),
    "run": ((1, 1), "<test> [run flags]"),
    "run-all": ((0, 0), "[run flags]"),
    "results": ((0, 1), "[<test>]"),
}
RUN_FLAGS = ("limit", "temperature", "max_new_tokens", "no_save", "verbose",
             "resume", "retries", "workers", "fail_under")
STANDALONE_ONLY = ("server", "timeout", "fail_under")
CONNECTION_FLAGS = ("server", "timeout")   # accepted with any subcommand


def _int_in(low, high):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise ValueError("expects a whole number, not %r" % text)
        if value < low or (high is not None and value > high):
            raise ValueError("must be %s" % ("at least %d" % low if high is None
                                              else "from %d to %d" % (low, high)))
        return value
    return parse


def _float_in(low, high, low_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise ValueError("expects a number, not %r" % text)
        if not math.isfinite(value) or value < low or (low_open and value == low) \
                or (high is not None and value > high):
            raise ValueError("must be a finite number %s" % (
                "above %g" % low if low_open else "of at least %g" % low)
                + ("" if high is None else " and at most %g" % high))
        return value
    return parse


FLAGS = {   # flag: (option, parser or None for a switch, value name, help)
    "--limit": ("limit", _int_in(1, None), "N", "ask only the first N questions"),
    "--temp": ("temperature", _float_in(0.0, None), "F",
               "sampling temperature (default %g: greedy)" % DEFAULTS["temperature"]),
    "--max-new": ("max_new_tokens", _int_in(1, None), "N",
                  "most new tokens per reply (default %d)" % DEFAULTS["max_new_tokens"]),
    "--no-save": ("no_save", None, "", "write no result file and no journal"),
    "--verbose": ("verbose", None, "", "one line per question"),
    "--resume": ("resume", None, "", "continue the newest unfinished run of the test"),
    "--retries": ("retries", _int_in(0, MAX_RETRIES), "N",
                  "retries of a failed request (default %d)" % DEFAULTS["retries"]),
    "--workers": ("workers", _int_in(1, MAX_WORKERS), "N",
                  "questions in flight at once (default %d)" % DEFAULTS["workers"]),
    "--server": ("server", str, "URL",
                 "endpoint (default %s; 'mock' works offline)" % DEFAULTS["server"]),
    "--timeout": ("timeout", _float_in(0.0, None, low_open=True), "S",
                  "seconds per request (default %g)" % DEFAULTS["timeout"]),
    "--fail-under": ("fail_under", _float_in(0.0, 100.0), "PCT", "exit 1 when accuracy is below PCT"),
}


def parse_command(args, standalone):
    """Return (subcommand, positional arguments, options) or raise UsageError."""
    opts = dict(DEFAULTS)
    positional, seen = [], set()
    tokens = list(args)
    while tokens:
        token = tokens.pop(0)
        if token in ("-h", "--help"):
            return "help", [], opts
        if not token.startswith("--"):
            positional.append(token)
            continue
        flag, _, value = token.partition("=")
        if flag not in FLAGS:
            raise UsageError("unknown flag %s" % clean(flag))
        option, parse = FLAGS[flag][:2]
        if option in STANDALONE_ONLY and not standalone:
            raise UsageError("%s belongs to the standalone command, not the plugin" % flag)
        if parse is None:
            if value:
                raise UsageError("%s takes no value" % flag)
            opts[option] = True
        else:
            if not value:
                if not tokens:
                    raise UsageError("%s needs a value" % flag)
                value = tokens.pop(0)
            try:
                opts[option] = parse(value)
            except ValueError as exc:
                raise UsageError("%s %s" % (flag, clean(exc)))
        seen.add(option)
    sub = positional.pop(0).lower() if positional else "help"
    if sub not in SUBCOMMANDS:
        raise UsageError("unknown subcommand %r" % clean(sub), brief=True)
    low, high = SUBCOMMANDS[sub][0]
    if len(positional) < low:
        raise UsageError("%s needs a test name" % sub)
    if len(positional) > high:
        raise UsageError("%s: unexpected argument %r" % (sub, clean(positional[high])))
    misplaced = seen - set(CONNECTION_FLAGS) - (set(RUN_FLAGS) if sub in ("run", "run-all") else set())
    if misplaced:
        flag = next(f for f, spec in FLAGS.items() if spec[0] in misplaced)
        raise UsageError("%s only goes with run and run-all" % flag)
    if opts["resume"] and opts["no_save"]:
        raise UsageError("--resume needs the journal, so it cannot go with --no-save")
    return sub, positional, opts


def usage_lines(prog, standalone):
    lines = ["usage: %s <subcommand>, where <subcommand> is one of:" % prog]
    for sub, (_, usage) in SUBCOMMANDS.items():
        lines.append(("  %s %s" % (sub, usage)).rstrip())
    lines.append("flags:")
    for flag, (option, _, value, text) in FLAGS.items():
        if standalone or option not in STANDALONE_ONLY:
            lines.append("  %-17s %s" % (("%s %s" % (flag, value)).strip(), text))
    return lines


def help_lines(prog, workspace, standalone):
    return ["Evaluator %s: multiple-choice benchmarks for the current endpoint." % VERSION,
            ""] + usage_lines(prog, standalone) + [
        "",
        "tests:   %s" % workspace.tests_dir,
        "results: %s" % workspace.results_dir,
        "",
        "Test files are JSON Lines. An optional first line",
        '  {"_meta": true, "name": "...", "description": "..."}',
        "then one question per line:",
        '  {"id": "geo1", "category": "geography", "question": "...",',
        '   "choices": ["Berlin", "Paris", "Madrid", "Rome"], "answer": "B"}',
        "2 to 26 choices; answer is a letter (B, (B), B.) or a 0-based index.",
    ]


class App(object):
    """Carries out one subcommand; the plugin and the command line both use it."""

    def __init__(self, workspace, term, endpoint_factory, prog, standalone):
        self.ws, self.term = workspace, term
        self.endpoint_factory = endpoint_factory
        self.prog, self.standalone = prog, standalone
        self.unsaved = False     # a result could be saved nowhere

    def say(self, text="", colour=""):
        self.term.line(text, colour)

    def warn(self, text):
        self.term.line("warning: " + text, "YELLOW")

    def execute(self, args):
        """Run the command line ``args``; return the exit status."""
        try:
            sub, positional, opts = parse_command(args, self.standalone)
        except UsageError as exc:
            self.say("error: %s" % exc, "RED")
            for line in [] if exc.brief else usage_lines(self.prog, self.standalone):
                self.say(line)
            self.say("Type %s help for the details." % self.prog)
            return EXIT_USAGE
        handler = getattr(self, "cmd_" + sub.replace("-", "_"))
        return handler(positional, opts)

    def cmd_help(self, positional, opts):
        for line in help_lines(self.prog, self.ws, self.standalone):
            self.say(line)
        return EXIT_OK

    def cmd_list(self, positional, opts):
        paths = self.ws.test_paths()
        if not paths:
            self.say("No tests in %s (add .jsonl files there)." % self.ws.tests_dir)
            return EXIT_OK
        self.say("Tests in %s:" % self.ws.tests_dir, "BOLD")
        rows = []
        for path in paths:
            try:
                test = load_test(path)
            except TestFileError as exc:
                rows.append(([os.path.basename(path), "error: " + exc.problems[0]], "RED"))
                continue
            rows.append(([test.file, test.name, "%d questions" % len(test.questions),
                          preview(test.description, 70)], ""))
        self._table(rows)
        return EXIT_OK

    def _table(self, rows):
        """Print rows of cells, every column but the last padded to one width."""
        rows = [([clean(c) for c in cells], colour) for cells, colour in rows]
        widths = {}
        for cells, _ in rows:
            for i, cell in enumerate(cells[:-1]):
                widths[i] = max(widths.get(i, 0), len(cell))
        for cells, colour in rows:
            self.say("  " + "  ".join([c.ljust(widths[i]) for i, c in enumerate(cells[:-1])]
                                      + cells[-1:]), colour)

    def _load(self, name):
        """The test called ``name``, or None after printing why it cannot be used."""
        path = self.ws.find_test(name)
        if not os.path.isfile(path):
            self.say("error: no test %s (looked for %s); %s list shows the tests" % (
                clean(name), clean(path), self.prog), "RED")
            return None
        try:
            return load_test(path)
        except TestFileError as exc:
            self.say("error: %s cannot be used:" % clean(os.path.basename(path)), "RED")
            for problem in exc.problems:
                self.say("  " + clean(problem), "RED")
            return None

    def cmd_info(self, positional, opts):
        test = self._load(positional[0])
        if test is None:
            return EXIT_USAGE
        counts = {}
        for q in test.questions:
            key = q["category"] or UNCATEGORISED
            counts[key] = counts.get(key, 0) + 1
        first = test.questions[0]
        self.say("file: %s" % clean(test.path))
        self.say("name: %s" % clean(test.name))
        self.say("description: %s" % clean(test.description or "-"))
        self.say("questions: %d" % len(test.questions))
        self.say("categories: %s" % ", ".join("%s %d" % (clean(c), n) for c, n in counts.items()))
        self.say("first question (%s):" % clean(first["id"]))
        self.say("  " + clean(first["question"]))
        for line in choices_block(first["choices"]).split("\n"):
            self.say("  " + clean(line))
        self.say("  answer: %s" % first["answer"])
        return EXIT_OK

    def cmd_results(self, positional, opts):
        paths = result_files(self.ws.results_dir)
        if positional:
            return self._show_result(test_base(positional[0]), paths)
        if not paths:
            self.say("No results yet in %s." % self.ws.results_dir)
            return EXIT_OK
        self.say("Results in %s (newest first):" % self.ws.results_dir, "BOLD")
        rows = []
        for path in paths[:RECENT_RESULTS]:
            result, why = read_result(path)
            name = os.path.basename(path)
            if why:
                rows.append(([name, "unreadable: " + why], "YELLOW"))
            else:
                rows.append(([name, "%d/%d" % (result["correct"], result["total"]),
                              percent(result["accuracy"]), "model %s%s" % (
                                  result.get("model", "unknown"),
                                  "  (interrupted)" if result.get("interrupted") else "")], ""))
        self._table(rows)
        if len(paths) > RECENT_RESULTS:
            self.say("  ... and %d older" % (len(paths) - RECENT_RESULTS))
        return EXIT_OK

    def _show_result(self, base, paths):
        for path in paths:
            result, why = read_result(path)
            if result is not None and result["test"] == base:
                break
        else:
            self.say("No results for %s in %s." % (clean(base), self.ws.results_dir))
            return EXIT_OK
        self.say("file: %s" % clean(path))
        for field in ("test_name", "model", "endpoint", "timestamp"):
            self.say("%s: %s" % (field.replace("_", " "), clean(result.get(field, "-"))))
        for text, colour in summary_lines(result):
            self.say(text, colour)
        return EXIT_OK

    # -- running ---------------------------------------------------------

    def _endpoint(self, opts):
        try:
            return self.endpoint_factory(opts)
        except ValueError as exc:
            self.say("error: %s" % clean(exc), "RED")
            return None

    def cmd_run(self, positional, opts):
        test = self._load(positional[0])
        if test is None:
            return EXIT_USAGE
        endpoint = self._endpoint(opts)
        if endpoint is None:
            return EXIT_USAGE
        result = self.run_test(test, endpoint, endpoint.model_name(), opts)
        return self._status([result], opts)

    def cmd_run_all(self, positional, opts):
        paths = self.ws.test_paths()
        if not paths:
            self.say("No tests in %s." % self.ws.tests_dir)
            return EXIT_USAGE
        endpoint = self._endpoint(opts)
        if endpoint is None:
            return EXIT_USAGE
        model = endpoint.model_name()
        rows, results, broken = [], [], False
        for path in paths:
            self.say()
            self.say("=== %s ===" % clean(os.path.basename(path)), "CYAN")
            test = self._load(path)
            if test is None:
                rows.append((os.path.basename(path), None))
                broken = True
                continue
            result = self.run_test(test, endpoint, model, opts)
            rows.append((test.file, result))
            results.append(result)
            if result["interrupted"]:
                break
        self._suite_summary(rows, results)
        status = self._status(results, opts)
        return EXIT_USAGE if broken and status in (EXIT_OK, EXIT_BELOW_THRESHOLD) else status

    def _suite_summary(self, rows, results):
        self.say()
        self.say("Suite summary", "BOLD")
        width = max(len(clean(name)) for name, _ in rows + [("total", None)])
        for name, result in rows:
            if result is None:
                self.say("  %-*s  skipped (cannot load)" % (width, clean(name)), "RED")
            else:
                self.say("  %-*s  %4d/%-4d %s%s" % (
                    width, clean(name), result["correct"], result["total"],
                    percent(result["accuracy"]), "  (stopped early)" if result["interrupted"] else ""))
        correct = sum(r["correct"] for r in results)
        total = sum(r["total"] for r in results)
        self.say("  %-*s  %4d/%-4d %s" % (width, "total", correct, total,
                                          percent(_ratio(correct, total))), "BOLD")

    def _status(self, results, opts):
        if any(r["stop_reason"] == CTRL_C for r in results):
            return EXIT_INTERRUPTED
        if self.unsaved:
            return EXIT_UNSAVED
        if any(r["interrupted"] for r in results):
            return EXIT_ENDPOINT
        if opts["fail_under"] is not None:
            correct = sum(r["correct"] for r in results)
            total = sum(r["total"] for r in results)
            if 100.0 * _ratio(correct, total) < opts["fail_under"]:
                self.say("accuracy %s is below --fail-under %g%%" % (
                    percent(_ratio(correct, total)), opts["fail_under"]), "RED")
                return EXIT_BELOW_THRESHOLD
        return EXIT_OK

    def _journal_for(self, test, opts, header, stamp):
        """The journal and the answers already known for this run."""
        runs = [] if opts["no_save"] else unfinished_runs(self.ws.results_dir, test.base)
        matching = [r for r in runs if all(r[1].get(k) == header[k] for k in RESUME_KEYS)]
        if opts["resume"] and matching:
            path, _, known = matching[0]
            self.say("Resuming %s: %d of %d questions already answered." % (
                clean(os.path.basename(path)),
                sum(1 for d in known.values() if "error" not in d), header["questions"]))
            return Journal(path, self.warn), known
        if opts["resume"]:
            self.say("No unfinished run of %s with these settings; starting a new one." % clean(test.base))
        elif runs:
            self.say("Note: an unfinished run of %s exists (%s); add --resume to continue it." % (
                clean(test.base), clean(os.path.basename(runs[0][0]))), "YELLOW")
        if opts["no_save"]:
            return Journal(), {}
        return Journal.start(self.ws.results_dir, header, stamp, self.warn), {}

    def run_test(self, test, endpoint, model, opts):
        """Ask one test's questions; print and save the result; return it."""
        questions = select_questions(test, opts["limit"])
        params = run_params(opts)
        stamp = _stamp()
        info = {"test": test.base, "test_name": test.name, "model": model,
                "endpoint": endpoint.label, "timestamp": _now_iso(), "params": params,
                "prompt_template": DEFAULT_PROMPT_TEMPLATE}
        header = dict(info, journal=1, file=test.path, questions=len(questions),
                      fingerprint=fingerprint(questions))
        for text, colour in header_lines(test, model, endpoint.label, len(questions), opts):
            self.say(text, colour)
        journal, known = self._journal_for(test, opts, header, stamp)
        run = Run(info, questions, {i: d for i, d in known.items() if i < len(questions)})
        progress = Progress(self.term, len(questions), opts["verbose"], run.details.values())
        try:
            execute_run(run, endpoint.asker(sampling_override(
                opts["temperature"], opts["max_new_tokens"])), opts, journal, progress)
        finally:
            journal.close()
        result = run.result()
        try:
            self._report(result, run, progress)
        finally:
            if not opts["no_save"]:
                self._save(result, journal, stamp)
        return result

    def _report(self, result, run, progress):
        if run.stop_reason == CTRL_C:
            self.say("Interrupted after %d of %d questions." % (
                len(run.details), len(run.questions)), "YELLOW")
        elif run.stop_reason:
            self.say("Stopped: %s (endpoint %s). %d of %d questions were asked." % (
                clean(run.stop_reason), clean(run.info["endpoint"]), len(run.details),
                len(run.questions)), "RED")
        for text, colour in summary_lines(result):
            self.say(text, colour)
        self.say("  time: %.2f s, %.2f questions/s" % (
            run.elapsed, _ratio(progress.asked, run.elapsed)), "GREY")

    def _save(self, result, journal, stamp):
        try:
            path = save_result(result, self.ws.results_dir, stamp)
        except OSError as exc:
            self.say("Could not save to %s (%s)." % (self.ws.results_dir, exc.strerror or exc), "RED")
            path = self._save_elsewhere(result, stamp)
            if path is None:
                self.unsaved = True
                if journal.path:
                    self.say("The answers are still in the journal %s." % journal.path, "YELLOW")
                return
        self.say("  saved: %s" % path, "GREEN")
        if not result["interrupted"]:
            journal.remove()

    def _save_elsewhere(self, result, stamp):
        fallback = os.path.join(tempfile.gettempdir(), "evaluator-results")
        try:
            os.makedirs(fallback, exist_ok=True)
            return save_result(result, fallback, stamp)
        except OSError as exc:
            self.say("Could not save a copy in %s either (%s)." % (fallback, exc.strerror or exc), "RED")
            return None


# ---- the Plugin class ---------------------------------------------------------

class EvaluatorPlugin(Plugin):
    name = "evaluator"
    description = "Run multiple-choice benchmarks against the current endpoint"
    commands = ["/evaluator", "/eval"]

    def on_load(self, ctx):
        for warning in Workspace().prepare():
            _safe_print("[evaluator] warning: " + warning)

    def help_text(self):
        return "\n".join(help_lines("/eval", Workspace(), standalone=False))

    def handle(self, cmd, args, ctx):
        term = Terminal(sys.stdout, Color)   # the host blanks Color for --no-color
        app = App(Workspace(), term, lambda opts: HostEndpoint(ctx), cmd or "/eval", False)
        try:
            with interrupt_once():
                app.execute(list(args or []))
        except KeyboardInterrupt:
            term.line("evaluator: interrupted", "YELLOW")
        except Exception as exc:   # the host must never see a traceback from us
            term.line("evaluator: internal error: %s: %s" % (
                exc.__class__.__name__, clean(exc)), "RED")


def _safe_print(text):
    with contextlib.suppress(Exception):
        Terminal(sys.stdout).line(text)


# ---- the standalone entry point -----------------------------------------------

def standalone_endpoint(opts):
    if opts["server"].strip().lower() == "mock":
        return MockEndpoint()
    return HttpEndpoint(opts["server"], opts["timeout"])


def main(argv=None):
    """``python evaluator.py <subcommand> [flags]``; returns the exit status."""
    term = Terminal(sys.stdout)
    prog = "python " + (sys.argv[0] if sys.argv[0].endswith(".py") else os.path.basename(__file__))
    with contextlib.suppress(ValueError):   # this process is ours: no handler to restore
        signal.signal(signal.SIGINT, _raise_once([]))
    try:
        workspace = Workspace()
        for warning in workspace.prepare():
            term.line("warning: " + warning, "YELLOW")
        return App(workspace, term, standalone_endpoint, prog, True).execute(
            sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        term.line("interrupted", "YELLOW")
        return EXIT_INTERRUPTED
    except Exception as exc:
        term.line("internal error: %s: %s" % (exc.__class__.__name__, clean(exc)), "RED")
        return EXIT_INTERNAL


if __name__ == "__main__":
    status = main()
    with contextlib.suppress(ValueError):   # a late Ctrl-C must not change the status
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
    except OSError:   # the reader went away: let the exit flush write nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(status)
