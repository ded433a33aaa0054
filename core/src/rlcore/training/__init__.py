"""What training backends share: optimizer steps, token logprobs, attention, LoRA, weights, schedules and safe checkpoint loading; imports config, interfaces, data and algorithms."""
