"""What the tests, CI and the SASS tools import: the CPU compile check (`compile_check`) and the PTX interpreter
that executes the stages' fragments (`ptx_interp`). May import any of fa4_rowmax; nothing else in fa4_rowmax
imports it. Importing this package imports nothing else."""
