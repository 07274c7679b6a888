"""The CPU platform: Kev's compiled kernels and what installs them on a model.

`kernels` builds and loads `csrc/` once per environment (`build_lock`: one builder at a time;
`isa`: the instruction sets to build for, and `KEV_CPU_ISA` to build as a smaller CPU would);
`ops` is Kev's model's ops over the kernels; on the transformers fallback, `exact_linear` and
`rows_linear` give `nn.Linear` Kev's products (batch-invariant at every row count, or fast for
few rows), `inplace` and `rotary_table` the elementwise work; `exact` and `fast` are the
attention backends over the kernels. One word each: "exact" is the batch-invariant path (its
kernel build, attention backend, ops and products), "fast" the path that is not (its build,
backend, ops); "compiled" is only `cpu_kernels="compiled"`: Kev's kernels or an error.
"""
