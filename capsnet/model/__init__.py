"""The model of the paper: dynamic routing (routing), the capsule layers
(layers), the margin and reconstruction losses (losses), the CPU's fast
convolutions (fast_conv), and the graph builder that puts them together
(network). Knows nothing of files, sessions or flags."""
