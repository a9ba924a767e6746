"""`python -m gpuledger.cli …`: how the tests, exercises and benchmarks start services."""

from gpuledger.cli import main

main()
