"""``hf-ext`` command modules (see :mod:`hf_ext.cli`)."""
