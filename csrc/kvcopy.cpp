#include <pybind11/pybind11.h>
namespace py = pybind11;
PYBIND11_MODULE(_kvcopy, m) { m.doc() = "placeholder"; }
