"""One step of the model: the model runner (a batch in, logits out, through the engine's graphs
or the eager forward), its packed inputs, decode overlap and the step trace."""
