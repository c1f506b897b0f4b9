import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["gpu"]:  # the GPU check imports torch, numpy and the project only (no rich)
        from .gpu import main as gpu_main

        sys.exit(gpu_main())
    from .cli import main

    sys.exit(main())
