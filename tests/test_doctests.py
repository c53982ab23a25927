"""The `>>>` examples in the public API's docstrings run and give what they show."""
import doctest
import importlib

import pytest

MODULES = ["freqact.dct", "freqact.codecs.base", "freqact.models", "freqact.kernels", "freqact.engine.block",
           "freqact.rundir", "freqact.analysis.pipelines"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
