"""python -m models [--out DIR] [NAME ...]: same as python -m models.build."""

from models.build import main

main()
