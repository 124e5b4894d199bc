"""Pure tensor maths of GRPO: advantages, policy losses, logprobs. No config objects in here."""
