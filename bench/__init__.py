"""Benchmarks of aiayn against its peers and its floors; bench/README.md lists each. Run from the
repository root as ``python -m bench.<group>.<name>``."""
