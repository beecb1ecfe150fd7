from setuptools import find_packages, setup

setup(
    name="jitbatch",
    version="0.1.0",
    description="Just-in-time dynamic batching for Apache MXNet Gluon",
    long_description=open("README.rst").read(),
    packages=find_packages(include=["jitbatch", "jitbatch.*", "examples", "examples.*"]),
    python_requires=">=3.8",
    install_requires=[
        "mxnet==1.9.1",
        "numpy>=1.20,<1.24",      # mxnet 1.9.1 uses np.bool
        "gluonnlp==0.10.0",       # built from source: needs cython (and wheel) first
        "cython",
        "scipy",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"test": ["pytest", "hypothesis"]},
)
