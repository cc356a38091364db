"""The Backend protocol is the contract: what the engine asks of a backend beyond evaluation is declared by
small capability protocols (SequencePool, PrefixCaching) that every backend implements, never probed for
with ``getattr`` defaults, so a backend or fake without one fails loudly instead of silently turning off
token trees or the prefix cache."""

import pytest
from fake_lm import TableLM

from specdec.backends.base import Backend, PrefixCaching, SequenceBook, SequencePool
from specdec.backends.cache import SequenceCache
from specdec.engine import Engine
from specdec.params import SpecConfig


def test_the_fake_implements_the_protocol_and_its_capabilities():
    lm = TableLM()
    assert isinstance(lm, Backend)  # every member present (the protocol is runtime-checkable)
    assert SequencePool in SequenceBook.__mro__ and PrefixCaching in SequenceBook.__mro__
    for name in ("n_seq_max", "capacity", "free_sequences", "prefix", "save_sequence", "load_sequence", "close"):
        assert hasattr(lm, name), name


def test_capacity_is_the_least_of_the_backends():
    target, draft = TableLM(n_seq_max=8), TableLM(n_seq_max=3, noise=0.3)
    assert Engine(target, draft, SpecConfig()).capacity == 3


def test_a_backend_without_a_capability_fails_loudly():
    """Before, ``getattr(backend, "prefix", None)`` turned the prefix cache off for such a backend."""

    class NoPrefix:
        n_seq_max = 1

        def new_sequence(self):
            return 0

    with pytest.raises(AttributeError, match="prefix"):
        SequenceCache(NoPrefix())
