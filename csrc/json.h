// A small JSON reader for the kernel_meta attribute (docs/format.md): parses a document
// into a tree of Json values. Numbers are kept as doubles (the schema's integers are small).
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "program.h"

namespace onnxfuse {

struct Json {
  enum Kind { NUL, BOOL, NUMBER, STRING, ARRAY, OBJECT } kind = NUL;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;

  const Json* get(const std::string& key) const {
    for (const auto& kv : obj)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }

  static Json parse(const std::string& text) {
    Parser p{text, 0};
    Json v = p.value(0);
    p.ws();
    if (p.i != text.size()) p.fail("trailing characters");
    return v;
  }

 private:
  struct Parser {
    const std::string& s;
    size_t i;

    [[noreturn]] void fail(const char* what) const {
      throw Error(std::string("invalid JSON (") + what + " at offset " + std::to_string(i) + ")");
    }
    void ws() {
      while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
    }
    bool lit(const char* w) {
      size_t n = std::char_traits<char>::length(w);
      if (s.compare(i, n, w) != 0) return false;
      i += n;
      return true;
    }
    static void utf8(std::string& out, uint32_t cp) {
      if (cp < 0x80) {
        out += static_cast<char>(cp);
      } else if (cp < 0x800) {
        out += static_cast<char>(0xc0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xe0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      } else {
        out += static_cast<char>(0xf0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      }
    }
    uint32_t hex4() {
      if (i + 4 > s.size()) fail("short \\u escape");
      uint32_t v = 0;
      for (int k = 0; k < 4; ++k) {
        char c = s[i++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
        else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
        else fail("bad \\u escape");
      }
      return v;
    }
    std::string string() {
      if (s[i] != '"') fail("expected a string");
      ++i;
      std::string out;
      while (true) {
        if (i >= s.size()) fail("unterminated string");
        char c = s[i++];
        if (c == '"') break;
        if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
        if (c != '\\') {
          out += c;
          continue;
        }
        if (i >= s.size()) fail("unterminated escape");
        char e = s[i++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            uint32_t cp = hex4();
            if (cp >= 0xd800 && cp < 0xdc00 && i + 1 < s.size() && s[i] == '\\' && s[i + 1] == 'u') {
              i += 2;
              uint32_t lo = hex4();
              if (lo < 0xdc00 || lo >= 0xe000) fail("bad surrogate pair");
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            utf8(out, cp);
            break;
          }
          default: fail("bad escape");
        }
      }
      return out;
    }
    Json value(int depth) {
      if (depth > 64) fail("nesting too deep");
      ws();
      if (i >= s.size()) fail("unexpected end");
      Json v;
      const char c = s[i];
      if (c == '{') {
        v.kind = OBJECT;
        ++i;
        ws();
        if (i < s.size() && s[i] == '}') {
          ++i;
          return v;
        }
        while (true) {
          ws();
          if (i >= s.size()) fail("unexpected end");
          std::string k = string();
          ws();
          if (i >= s.size() || s[i] != ':') fail("expected ':'");
          ++i;
          v.obj.emplace_back(std::move(k), value(depth + 1));
          ws();
          if (i < s.size() && s[i] == ',') {
            ++i;
            continue;
          }
          if (i < s.size() && s[i] == '}') {
            ++i;
            break;
          }
          fail("expected ',' or '}'");
        }
      } else if (c == '[') {
        v.kind = ARRAY;
        ++i;
        ws();
        if (i < s.size() && s[i] == ']') {
          ++i;
          return v;
        }
        while (true) {
          v.arr.push_back(value(depth + 1));
          ws();
          if (i < s.size() && s[i] == ',') {
            ++i;
            continue;
          }
          if (i < s.size() && s[i] == ']') {
            ++i;
            break;
          }
          fail("expected ',' or ']'");
        }
      } else if (c == '"') {
        v.kind = STRING;
        v.str = string();
      } else if (lit("true")) {
        v.kind = BOOL;
        v.b = true;
      } else if (lit("false")) {
        v.kind = BOOL;
      } else if (lit("null")) {
        v.kind = NUL;
      } else if (c == '-' || (c >= '0' && c <= '9')) {
        size_t j = i;
        if (s[j] == '-') ++j;
        while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '.' || s[j] == 'e' ||
                                s[j] == 'E' || s[j] == '+' || s[j] == '-'))
          ++j;
        std::string tok = s.substr(i, j - i);
        char* end = nullptr;
        v.kind = NUMBER;
        v.num = std::strtod(tok.c_str(), &end);
        if (end != tok.c_str() + tok.size()) fail("bad number");
        i = j;
      } else {
        fail("unexpected character");
      }
      return v;
    }
  };
};

}  // namespace onnxfuse
