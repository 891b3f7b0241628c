/* The shared library's own translation unit: liblfserve.so is the whole static library linked
 * in (CMakeLists.txt, lfserve_shared), which needs at least one source of its own. */
typedef int lf_shared_lib_unit;
