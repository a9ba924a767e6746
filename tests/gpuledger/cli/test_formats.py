"""The CLI's --format choices are the components' own lists (the CLI does not import them at start-up)."""

from gpuledger.cli.audit import AuditFormat
from sinks.read.audit import FORMATS


def test_audit_formats_are_the_read_sides_list():
    assert tuple(f.value for f in AuditFormat) == FORMATS
