"""draftcert's test suite, one folder per package (decode, models, profiling, replay, report, train),
the core library's tests at this level, and the independent oracles under tests/oracles/."""
