"""omnips/yamltext.py: what it writes, a YAML reader reads back as the same data."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.yamltext import dump_all

yaml = pytest.importorskip("yaml")

text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, blacklist_categories=("Cs",)), max_size=12)
words = st.sampled_from(["", "true", "No", "null", "~", "0", "1.5", "0x1F", "-", "- a", "a: b", "#x", "a #b", "*x",
                         "&y", "!t", "{}", "[]", "'q'", '"d"', "%", "@", "`", "on", "Y", "2026-12-02", "1e3", ".5",
                         "$(POD_IP)", "tcp://h:5555", "nvidia.com/gpu", "--from-file=keys/", " lead", "trail "])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), words, text)
data = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.one_of(words, text), inner, max_size=4)),
                    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.one_of(words, text), data, max_size=5), min_size=1, max_size=3))
def test_yaml_reads_back_what_was_written(documents):
    assert list(yaml.safe_load_all(dump_all(documents))) == documents
