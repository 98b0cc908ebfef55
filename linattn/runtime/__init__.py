"""Device facts, settings and the Gluon compatibility shim: everything that asks the machine a question."""
from linattn.runtime.settings import settings
from linattn.runtime.device import device_facts, DeviceFacts

__all__ = ["settings", "device_facts", "DeviceFacts"]
