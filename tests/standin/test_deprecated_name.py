"""`m3_agent.serving.standin`, the stand-in's old name, still imports for a release, and says where it went."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from m3_agent.serving.standin import EXHAUSTED_TEXT, StandinServer, _text_of
    import m3_agent.serving.standin as old
import m3_agent.standin.server as new
assert old is new and StandinServer is new.StandinServer and EXHAUSTED_TEXT == new.EXHAUSTED_TEXT
with StandinServer({"turns": [{"content": "hi"}]}) as srv:
    assert srv.base_url.endswith("/v1")
print([(w.category.__name__, str(w.message)) for w in caught])
"""


def test_the_old_name_is_the_new_module_and_warns_once():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("[('DeprecationWarning', 'm3_agent.serving.standin is deprecated: "
                                  "import m3_agent.standin.server instead')]")


def test_the_new_name_warns_nothing():
    code = "import m3_agent.standin.server, m3_agent.serving.cli"
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
