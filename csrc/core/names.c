/* names.c — the names of a graph's nodes (parameter paths, FX node names): the graph's own
 * copies, kept in blocks freed with the graph so a name may be any length, and a name's
 * spellings as text: quoted and escaped in the IR's dump, and in generated source, where a name
 * never becomes code, as a comment-safe string or a C identifier. */
#include "core/internal.h"

struct kb_name_block {
    struct kb_name_block *next;
    size_t size, used;     /* bytes of data, and how many hold names */
    char data[];
};

#define BLOCK_BYTES 4096

const char *kb_graph_keep_name(kb_graph *g, const char *name) {
    if (!name || !*name) return "";
    size_t len = strlen(name);
    struct kb_name_block *b = g->names;
    if (!b || b->size - b->used < len + 1) {
        size_t size = len + 1 > BLOCK_BYTES ? len + 1 : BLOCK_BYTES;
        b = kb_malloc(g->ctx, sizeof *b + size);
        if (!b) return NULL;
        b->size = size;
        b->used = 0;
        b->next = g->names;
        g->names = b;
    }
    char *copy = b->data + b->used;
    memcpy(copy, name, len + 1);
    b->used += len + 1;
    return copy;
}

void kb_graph_free_names(kb_graph *g) {
    for (struct kb_name_block *b = g->names, *next; b; b = next) {
        next = b->next;
        kb_free(g->ctx, b, sizeof *b + b->size);
    }
    g->names = NULL;
}

/* ---------------------------------------------------------------- spellings */

static int is_alpha(unsigned char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'); }
static int is_alnum(unsigned char ch) { return is_alpha(ch) || (ch >= '0' && ch <= '9'); }

void kb_sb_put_name(kb_sb *sb, const char *name, kb_name_style style) {
    if (style == KB_NAME_COMMENT) {
        char buf[KB_NAME_COMMENT_MAX + 4];
        kb_name_comment(name, buf, sizeof buf);
        kb_sb_printf(sb, "\"%s\"", buf);
        return;
    }
    kb_sb_puts(sb, "\"");
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        if (*p >= 0x20 && *p < 0x7f && *p != '"' && *p != '\\') {
            char one[2] = {(char)*p, '\0'};
            kb_sb_puts(sb, one);
        } else {
            kb_sb_printf(sb, "\\x%02x", *p);
        }
    }
    kb_sb_puts(sb, "\"");
}

void kb_name_comment(const char *name, char *out, size_t n) {
    static const char keep[] = " ._-:,=+#@()[]<>";
    size_t len = 0;
    if (!n) return;
    for (const unsigned char *p = (const unsigned char *)name; *p && len + 1 < n; p++) {
        if (len == KB_NAME_COMMENT_MAX) {
            if (n > len + 3) memcpy(out + len, "...", 3), len += 3;
            break;
        }
        out[len++] = is_alnum(*p) || strchr(keep, *p) ? (char)*p : '_';
    }
    out[len] = '\0';
}

void kb_name_ident(const char *name, char *out, size_t n) {
    if (!n) return;
    out[0] = '\0';
    /* the last dotted component, with the one before where it does not start with a letter */
    const char *last = strrchr(name, '.'), *from = last ? last + 1 : name;
    if (last && last > name && !is_alpha((unsigned char)*from) && *from != '_') {
        from = last;
        while (from > name && from[-1] != '.') from--;
    }
    char buf[KB_NAME_IDENT_MAX + 2];
    size_t len = 0;
    for (const unsigned char *p = (const unsigned char *)from; *p && len < KB_NAME_IDENT_MAX + 1; p++) {
        char ch = is_alnum(*p) ? (char)*p : '_';
        if (ch == '_' && (len == 0 || buf[len - 1] == '_')) continue; /* no leading or doubled '_' */
        buf[len++] = ch;
    }
    if (len == 0) return;
    if (buf[0] >= '0' && buf[0] <= '9') { /* "v" in front: an identifier starts with a letter */
        memmove(buf + 1, buf, len < KB_NAME_IDENT_MAX ? len : KB_NAME_IDENT_MAX);
        buf[0] = 'v';
        len = len < KB_NAME_IDENT_MAX ? len + 1 : KB_NAME_IDENT_MAX + 1;
    }
    if (len > KB_NAME_IDENT_MAX) len = KB_NAME_IDENT_MAX;
    while (len > 0 && buf[len - 1] == '_') len--;
    if (len >= n) len = n - 1;
    memcpy(out, buf, len);
    out[len] = '\0';
}
