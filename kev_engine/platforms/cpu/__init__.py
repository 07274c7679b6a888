"""The CPU platform: Kev's compiled kernels and what installs them on a model.

`kernels` builds and loads `csrc/` once per environment (`build_lock`: one builder at a time;
`isa`: the instruction sets to build for, and `KEV_CPU_ISA` to build as a smaller CPU would);
`ops` is Kev's model's ops over the kernels; on the transformers fallback, `exact_linear` and
`rows_linear` give `nn.Linear` Kev's products (batch-invariant at every row count, or fast for
few rows), `inplace` and `rotary_table` the elementwise work; `exact` and `compiled` are the
attention backends over the kernels.
"""
