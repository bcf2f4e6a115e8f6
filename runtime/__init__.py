"""tandem: the coordinator side (no GPU code, no torch on the hot path).

`runtime.Engine` is the one Python API of the serving runtime (see runtime/engine.py).
"""

from runtime.engine import Completion, Engine, EngineError, EngineOptions, Event, RequestStream  # noqa: F401
from runtime.sampling import SamplingParams  # noqa: F401
