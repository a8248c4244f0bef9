// A kernel.cu that does not compile, for the error row of `kbench bench --suite` (it stops at the
// preprocessor, so the failed build takes a second, not a torch-header compile).
#error "this candidate does not compile"
#include <torch/extension.h>
