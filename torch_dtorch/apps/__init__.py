"""Applications built on torch_dtorch: the demo, and later Llama and diffusion model glue."""
