"""Slurm: the sbatch templates, ``greenroom slurm render|submit`` and a submitit API."""
