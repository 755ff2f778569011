"""The bounds of a request's sampling parameters: the OpenAI API's where it has them, vLLM's
where it has them, and where neither has one, what bounds the work a request may cost."""

MAX_TEMPERATURE = 100.0
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in the OpenAI API
MAX_REPETITION_PENALTY = 100.0  # a factor: past this every seen token is banned in effect
# and its inverse the least: a seen token's logit is divided by the factor, which must keep a
# float32 logit finite (a denormal factor made it infinite, and the sampler's probabilities NaN)
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
MAX_LOGPROBS = 20  # alternatives per token, the OpenAI chat limit
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as in the OpenAI API
# Stop strings are matched incrementally (a step costs its new text times their number), and
# each keeps a table as long as itself: their number and their whole length are bounded.
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 65_536
MAX_BAD_WORDS = 1024
