"""fastddrive: fast block-diffusion vision-language driving planners (Fast-dDrive)."""

__version__ = "0.1.0"
