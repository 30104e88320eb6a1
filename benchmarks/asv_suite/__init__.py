"""asv benchmark suites, one module per family (asv.conf.json's benchmark_dir)."""
