"""What the tests, CI and the SASS studies import: the CPU compile check (`compile_check`), the PTX interpreter
that executes the stages' fragments (`ptx_interp`), SASS readers (`sass`) and adversarial Fused-Softmax inputs
(`fused_softmax_inputs`). May import any of fa4_rowmax; nothing else in fa4_rowmax imports it. Importing this
package imports nothing else."""
