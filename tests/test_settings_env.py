"""linattn.runtime.settings reads LINATTN_* variables from os.environ's own dict on the eager hot path: every value
it returns must be os.environ.get's, through every way a program changes os.environ."""
import importlib
import os
import uuid

import pytest

from linattn.runtime.settings import settings

settings_mod = importlib.import_module("linattn.runtime.settings")   # the module (the package exports the object)


def test_env_read_follows_os_environ(monkeypatch):
    name = "LINATTN_TEST_" + uuid.uuid4().hex[:8].upper()
    value = uuid.uuid4().hex
    assert settings_mod._env(name, "dflt") == "dflt"
    os.environ[name] = value
    try:
        assert settings_mod._env(name, "dflt") == value == os.environ.get(name)
        os.environ[name] = value + "x"                      # overwritten
        assert settings_mod._env(name, "dflt") == value + "x"
        os.environ.update({name: "é" + value})              # non-ASCII through update()
        assert settings_mod._env(name, "dflt") == os.environ.get(name) == "é" + value
    finally:
        os.environ.pop(name, None)
    assert settings_mod._env(name, "dflt") == "dflt"
    monkeypatch.setenv(name, value)
    assert settings_mod._env(name, "dflt") == value


@pytest.mark.parametrize("backend", ["triton", "reference", "gluon"])
def test_default_backend_follows_setenv(monkeypatch, backend):
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    assert settings.default_backend == "auto"
    monkeypatch.setenv("LINATTN_BACKEND", backend)
    assert settings.default_backend == backend
    monkeypatch.setenv("LINATTN_LOG", "yes")
    assert settings.log_choices is True
    monkeypatch.setenv("LINATTN_LOG", "0")
    assert settings.log_choices is False


def test_env_read_without_environ_internals(monkeypatch):
    """A Python whose os.environ lacks the internals: the same values through os.environ.get."""
    monkeypatch.setattr(settings_mod, "_ENV_FAST", False)
    monkeypatch.setenv("LINATTN_BACKEND", "triton")
    assert settings.default_backend == "triton"
    monkeypatch.delenv("LINATTN_BACKEND")
    assert settings.default_backend == "auto"
