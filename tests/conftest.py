import pytest

import support


@pytest.fixture
def plugins(tmp_path):
    """A plugins/ folder with a fresh copy of the plugin."""
    return support.install_plugin(tmp_path)


@pytest.fixture
def endpoints():
    """Start loopback endpoints: ``endpoints(script)``; all closed afterwards."""
    started = []

    def start(script=None, **kwargs):
        endpoint = support.Endpoint(script, **kwargs)
        started.append(endpoint)
        return endpoint
    yield start
    for endpoint in started:
        endpoint.close()


@pytest.fixture
def host(plugins, endpoints):
    """A host (1.3.0 context) whose endpoint answers from ``host.answers``."""
    state = {"answers": {}}
    endpoint = endpoints(lambda body, n: state["answers"].get(support.question_of(body), "Z"))
    h = support.Host(str(plugins), lambda: support.NewContext(endpoint.url))
    h.endpoint, h.answers, h.plugins_path = endpoint, state["answers"], plugins
    return h
