"""CapsNet (Sabour, Frosst & Hinton 2017) in TensorFlow 1.x-style graph mode."""
