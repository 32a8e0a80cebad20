"""Inputs beside text for vision-language models: images read and processed for the vision tower."""
