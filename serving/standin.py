"""Deprecated: the stand-in moved to `m3_agent.standin.server`; this old name works for one more release."""

import sys
import warnings

from m3_agent.standin import server

warnings.warn("m3_agent.serving.standin is deprecated: import m3_agent.standin.server instead",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = server  # the same module object: every name, private ones too, and no second copy
