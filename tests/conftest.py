"""Test-wide settings: a private model cache, so tests never read or write the user's ~/.cache/postrl."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    os.environ["POSTRL_CACHE"] = str(tmp_path_factory.mktemp("postrl-cache"))
    yield
