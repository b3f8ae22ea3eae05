"""The docstring examples of trainer.data run and hold."""

import doctest
import importlib

import pytest

MODULES = ["sources", "synthetic", "preprocess", "splits", "pipeline", "files", "prepare"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(f"trainer.data.{name}")
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0
