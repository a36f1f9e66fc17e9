// Sanitizer builds only (CMakeLists.txt compiles this into every executable that links
// moeinfer_core): leaks LeakSanitizer is told to pass over, because they are not moeinfer's.
//
// fontconfig, under cairo's text (bench.png): a program of a dozen lines that draws one string
// with cairo's toy font API and frees its context and surface still ends with 650 bytes lost
// in 7 allocations from libfontconfig (Debian 12's fontconfig 2.14.1, cairo 1.16).
extern "C" const char* __lsan_default_suppressions() { return "leak:libfontconfig.so\n"; }
// ... and without the table of suppressions used at exit, so that stderr holds only the program's own.
extern "C" const char* __lsan_default_options() { return "print_suppressions=0"; }
