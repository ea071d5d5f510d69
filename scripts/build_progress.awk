# The build's progress, from pip -v's output as it arrives (the Makefile keeps the whole of it in
# .stamp-build.log): the build's decisions once each (pip runs setup.py twice), then a line per compiled
# file, ninja's "[n/N]" kept, and one for the link.
/\[fastcollate build\]/ {
    line = $0
    sub(/^ */, "", line)
    if (!seen[line]++) print line
    fflush()
    next
}
{
    file = ""
    for (i = 1; i < NF; i++) if ($i == "-c") file = $(i + 1)
    sub(/.*\/csrc\//, "csrc/", file)
    if ($1 ~ /^\[[0-9]+\/[0-9]+\]$/ && file != "") print "  " $1 " " file
    else if (file ~ /\.(cpp|cu)$/) print "  compiling " file
    else if (/ -shared / && /_C[^ ]*\.so/) print "  linking fastcollate._C"
    else if (/Successfully installed fastcollate/) print "  installed (editable)"
    fflush()
}
