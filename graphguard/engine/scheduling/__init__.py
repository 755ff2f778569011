"""Which sequences run in a step, and where their KV lives: sequences, the paged KV pool and its
sizing, the scheduler and the batch it hands the model runner."""
