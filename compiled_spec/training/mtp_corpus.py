"""Text on every machine, by domain, for training MTP modules: code (the Python standard library's source),
prose (the Shakespeare plays) and chat (the base model's own answers to instruction prompts).

Each domain has a held-out part that training never sees: whole stdlib modules, whole plays, and chat prompts
on topics of their own.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
import sysconfig
import zlib
from pathlib import Path

from .corpus import fetch_texts_dir, read_works, split_works

DOMAINS = ("code", "prose", "chat")

CHAT_TEMPLATES = (
    "Explain {topic} to a beginner in a few sentences.",
    "What are three common mistakes people make with {topic}?",
    "Write a short paragraph about {topic}.",
    "Give me a step-by-step guide to {topic}.",
    "What is the history of {topic}?",
    "Write a Python function related to {topic} and explain it.",
)
CHAT_TOPICS = (
    "learning to cook rice", "photosynthesis", "saving money", "the water cycle", "sorting algorithms",
    "planting tomatoes", "the French revolution", "public speaking", "binary numbers", "volcanoes",
    "writing a cover letter", "the solar system", "sleep hygiene", "recursion", "climate change",
    "learning a new language", "the human heart", "time management", "prime numbers", "bread baking",
    "the Roman empire", "electric cars", "regular expressions", "meditation", "the stock market",
    "hash tables", "composting", "the printing press", "running a marathon", "unit testing",
)
# Training prompts only, after the ones above, so a corpus with more chat prompts keeps the earlier ones (and their
# cached answers). The held-out prompts use CHAT_TEMPLATES alone, so they stay the same as the corpus grows.
MORE_CHAT_TEMPLATES = (
    "Summarize the main ideas of {topic}.",
    "What should I know before I start with {topic}?",
    "Compare two different approaches to {topic}.",
    "Answer briefly: why does {topic} matter?",
    "Write a short story that involves {topic}.",
    "List five facts about {topic}.",
    "How would you teach {topic} to a child?",
    "Write a Python class that models {topic}, with docstrings.",
)
# More training topics, after the ones above for the same reason.
MORE_CHAT_TOPICS = (
    "the periodic table", "gardening in small spaces", "the Renaissance", "machine learning", "first aid",
    "the Great Wall of China", "personal budgeting", "black holes", "writing poetry", "the internet",
    "the Olympic games", "dinosaurs", "renewable energy", "job interviews", "the human brain", "knitting",
    "object-oriented programming", "the ancient Egyptians", "coffee brewing", "healthy breakfasts", "rainforests",
    "learning the guitar", "databases", "the theory of evolution", "camping", "the industrial revolution",
    "password security", "the ocean tides", "painting with watercolors", "vaccines", "the Silk Road",
    "functional programming", "bird watching", "the metric system", "starting a small business",
    "the greenhouse effect", "web browsers", "yoga", "the Cold War", "fractions", "pizza dough", "honey bees",
    "operating systems", "the Amazon river", "negotiation", "magnetism", "cloud computing", "the violin",
    "caring for a puppy", "the Byzantine empire", "spreadsheets", "earth's atmosphere", "cycling to work",
    "sorting a list in Python", "the design of chairs", "probability", "mountain climbing",
    "the Japanese tea ceremony", "graph algorithms", "recycling",
)
# Topics added after all of the above (each with every template), so the earlier prompts keep their order.
LATER_CHAT_TOPICS = (
    "the French language", "bicycles", "the water table", "learning to swim", "the Moon's phases", "glaciers",
    "home insulation", "the Vikings", "simple interest", "sourdough starters", "lighthouses", "the blockchain",
    "houseplants", "the Mongol empire", "the speed of light", "card games", "writing a resume", "bridges",
    "the circulatory system", "wind turbines", "the Python dictionary", "string formatting in Python",
    "sorting files on a computer", "the Greek myths", "volunteering", "the rainbow", "keyboard shortcuts",
    "the Pythagorean theorem", "photography", "deserts", "lists in Python", "the human skeleton", "wolves",
    "the American civil war", "soap making", "climbing stairs for exercise", "the Fibonacci sequence",
    "email etiquette", "the ancient Greeks", "solar panels", "decision trees", "coral reefs", "the piano",
    "writing clean code", "the stars", "the Eiffel Tower", "choosing a laptop", "logarithms", "penguins",
    "exception handling in Python", "the postal service", "team sports", "the weather forecast", "mushrooms",
    "command line basics", "the Titanic", "kindness", "the number zero", "trains", "reading more books",
    "the Nile river", "learning to draw", "binary search", "the Aztec empire", "compound interest", "fermentation",
    "the human eye", "public libraries", "sharks", "French cooking", "generators in Python", "rock climbing",
    "the Hubble telescope", "writing a novel", "statistics", "electric circuits", "the Ottoman empire",
    "stacks and queues", "tornadoes", "urban gardening", "the theory of relativity", "making pasta",
    "list comprehensions in Python", "the Incas", "nutrition labels", "hiking safety", "digital privacy",
    "the Great Depression", "matrix multiplication", "butterflies", "home workouts", "the history of jazz",
    "decorators in Python", "the Sahara desert", "car maintenance", "quantum computing", "the northern lights",
    "origami", "dynamic programming", "elephants", "renting an apartment", "the nitrogen cycle", "calligraphy",
    "the Ming dynasty", "unit conversion", "the structure of DNA", "file handling in Python", "pollination",
    "the Maya civilization", "customer service", "hurricanes", "big O notation", "board games",
    "the digestive system", "skateboarding", "inflation", "tidying a room", "JSON files", "octopuses",
    "the history of chocolate", "nuclear power", "doing laundry", "the Persian empire", "web servers",
    "the scientific method", "making ice cream", "bird migration", "the impressionist painters", "vegetable soup",
    "async programming in Python", "the Arctic", "the Magna Carta", "geometry", "learning to juggle",
    "freshwater lakes", "the telephone", "autumn leaves", "typing faster", "the Spanish language", "dolphins",
    "cheese making", "the speed of sound", "data visualization", "steam engines", "writing a thank-you note",
    "classes and inheritance in Python", "the Colosseum", "the rock cycle", "fire safety", "the Black Death",
    "counting calories", "SQL queries", "the Wright brothers", "snowflakes",
    "the Industrial Age in Britain", "tide pools", "learning to knit socks", "the Andes mountains", "kites",
    "the human lungs", "writing a haiku", "the Panama Canal", "rainwater harvesting", "sets in Python",
    "tuples in Python", "the Louvre museum", "sunflowers", "the Roman alphabet", "saving for retirement",
    "the French Alps", "paper making", "electric guitars", "the kidneys", "sea turtles", "growing strawberries",
    "the history of the bicycle", "weaving baskets", "the Great Barrier Reef", "string methods in Python",
    "the while loop", "for loops in Python", "lambda functions", "the Python standard library",
    "virtual environments in Python", "reading CSV files", "writing unit tests with pytest", "type hints in Python",
    "the Linux terminal", "HTTP requests", "HTML basics", "CSS layouts", "JavaScript promises", "REST APIs",
    "linear regression", "neural networks", "the bubble sort", "merge sort", "quicksort", "trees in computer science",
    "breadth-first search", "depth-first search", "caching", "memory management", "threads and processes",
    "text encoding and Unicode", "floating point numbers", "random numbers", "date and time handling",
    "command line arguments", "logging in Python", "debugging a program", "code reviews", "pair programming",
    "the history of computers", "Alan Turing", "Ada Lovelace", "the transistor", "the radio", "the camera",
    "the microscope", "the steam locomotive", "the compass", "the wheel", "paper money", "the calendar", "clocks",
    "the printing of newspapers", "the history of maps", "the Dead Sea", "the Himalayas", "Antarctica",
    "the Mississippi river", "the Alps", "volcanic islands", "caves", "waterfalls", "sand dunes", "wetlands",
    "prairies", "the savanna", "the tundra", "owls", "bees and wasps", "ants", "frogs", "whales", "horses", "cats",
    "parrots", "salmon", "spiders", "bats", "tigers", "kangaroos", "giraffes", "the octopus's brain", "apple trees",
    "oak trees", "cactus care", "herb gardens", "lawn care", "raising chickens", "beekeeping", "making jam",
    "roasting vegetables", "baking cookies", "grilling fish", "making curry", "salad dressings",
    "knife skills in the kitchen", "meal planning", "drinking enough water", "stretching", "posture at a desk",
    "running shoes", "swimming strokes", "learning to skate", "crossword puzzles", "sudoku", "magic tricks",
    "stand-up comedy", "writing song lyrics", "learning to sing", "the drums", "the history of rock music",
    "classical music", "opera", "ballet", "theater lighting", "movie editing", "animation", "comic books",
    "the history of video games", "podcasting", "journaling", "letter writing", "persuasive essays", "grammar rules",
    "punctuation", "learning vocabulary", "speed reading", "note taking", "studying for exams", "group projects",
    "giving feedback", "leading a meeting", "remote work", "planning a wedding", "moving house", "buying a used car",
    "home repairs", "painting a room", "fixing a leaky faucet", "saving energy at home", "choosing a mattress",
    "caring for a cat", "teaching a dog tricks", "the stock exchange", "taxes", "credit scores", "insurance",
    "supply and demand", "international trade", "the history of money", "democracy", "the United Nations",
    "human rights", "the space race", "the Apollo program", "Mars rovers", "the International Space Station",
    "comets", "the Sun", "eclipses", "gravity", "friction", "sound waves", "light and color", "atoms",
    "chemical reactions", "acids and bases", "plate tectonics", "fossils", "the carbon cycle", "ocean currents",
    "clouds", "lightning", "rain", "snow", "air pollution",
    "the Doppler effect", "buoyancy", "static electricity", "the boiling point of water", "rust and corrosion",
    "the life cycle of a star", "crystals", "the ozone layer", "geysers", "fungi in the forest", "the food chain",
    "camouflage in animals", "hibernation", "seed dispersal", "the life of a honeybee colony", "jellyfish",
    "hummingbirds", "polar bears", "koalas", "crows", "beavers", "bamboo", "redwood trees", "mangrove forests",
    "the Galapagos islands", "the Grand Canyon", "Iceland", "the Rhine river", "the Danube river",
    "the Gobi desert", "the Caribbean sea", "the Mediterranean diet", "fasting", "vitamins",
    "posture and back pain", "hand washing", "sunscreen", "dental care", "eye strain from screens",
    "hydration during sport", "weight lifting", "interval training", "pilates", "tai chi", "table tennis",
    "basketball", "tennis", "golf", "surfing", "sailing", "fishing", "archery", "skiing", "the rules of soccer",
    "cricket", "baseball statistics", "the Tour de France", "the Roman roads", "the pyramids of Giza", "Stonehenge",
    "the Hanseatic League", "the Qing dynasty", "the Meiji restoration", "the Renaissance in Florence",
    "the Reformation", "the invention of the telegraph", "the history of aviation", "the history of medicine",
    "the history of writing", "the history of glass", "the history of soap", "the history of the piano",
    "Marie Curie", "Isaac Newton", "Charles Darwin", "Leonardo da Vinci", "Nikola Tesla", "Grace Hopper",
    "Galileo Galilei", "Florence Nightingale", "Johannes Gutenberg", "Archimedes",
    "the Python for loop over a dictionary", "list slicing in Python", "the Python with statement",
    "dataclasses in Python", "enums in Python", "iterators in Python", "closures in Python",
    "the Python import system", "packaging a Python project", "reading JSON in Python", "pathlib in Python",
    "the collections module", "itertools", "the functools module", "context managers", "f-strings",
    "sorting with a key function", "the Python REPL", "writing a command line tool in Python",
    "parsing dates in Python", "the heapq module", "the subprocess module", "multiprocessing in Python",
    "asyncio tasks", "socket programming", "SQLite with Python", "web scraping", "regular expression groups",
    "hashing passwords", "unit conversion in code", "matrix operations in NumPy", "plotting with matplotlib",
    "pandas dataframes", "Docker containers", "continuous integration", "code formatting tools",
    "semantic versioning", "API documentation", "technical debt", "software licenses", "open source projects",
    "the Rust programming language", "the C programming language", "Java classes", "the Go language",
    "shell scripts", "cron jobs", "SSH keys", "DNS", "IP addresses", "TCP and UDP", "encryption",
    "two-factor authentication", "phishing emails", "backups", "file compression", "image formats",
    "the binary tree", "heaps and priority queues", "Dijkstra's algorithm", "the traveling salesman problem",
    "greedy algorithms", "string matching", "tries", "union-find", "topological sorting", "bit manipulation",
    "the Collatz conjecture", "Pascal's triangle", "prime factorization", "the greatest common divisor",
    "percentages", "ratios and proportions", "algebra basics", "negative numbers", "square roots", "the number pi",
    "the golden ratio", "symmetry", "tessellations", "probability with dice", "the Monty Hall problem",
    "averages and medians", "standard deviation", "bar charts", "correlation", "writing an essay",
    "writing a speech", "writing a product review", "writing a short mystery story", "writing dialogue",
    "editing your own writing", "keeping a diary", "writing a limerick", "storytelling", "learning Japanese",
    "learning Italian", "sign language", "idioms in English", "the English alphabet", "spelling bees",
    "palindromes", "anagrams", "riddles", "tongue twisters", "making pancakes", "baking a cake",
    "making soup stock", "homemade pickles", "making tortillas", "brewing kombucha", "smoothies",
    "roasting a chicken", "cooking with lentils", "sushi", "spices", "olive oil", "chocolate chip cookies",
    "breakfast cereals", "food safety in the kitchen", "organizing a closet", "decluttering", "ironing clothes",
    "sewing a button", "caring for leather shoes", "washing a car", "changing a tire", "assembling furniture",
    "hanging a picture", "unclogging a drain", "growing potatoes", "pruning roses", "bird feeders", "indoor herbs",
    "mulching", "saving for a house", "index funds", "budgeting for groceries", "paying off debt",
    "opening a bank account", "making a to-do list", "habits", "procrastination", "setting goals",
    "focus and attention", "making friends as an adult", "apologizing", "listening well", "teamwork", "mentoring",
    "museums", "theme parks", "zoos", "libraries of the ancient world", "castles", "jazz improvisation",
    "the saxophone", "the cello", "choirs", "music theory", "composing a melody", "sculpture", "pottery", "mosaics",
    "street art", "film noir", "puppetry", "circus acrobats", "fireworks", "hot air balloons", "submarines",
    "rockets", "satellites", "GPS", "3D printing", "robots", "drones", "smartphones", "batteries", "LED lights",
    "refrigerators", "microwave ovens", "elevators", "traffic lights", "bicycle gears", "sailboats and wind",
)
# A function's `def` line, at module level or in a class: a code prompt ending with one asks the model for the body.
DEF_LINE = re.compile(r"^    def \w+\(.*\):\n|^def \w+\(.*\):\n", re.MULTILINE)
HELD_OUT_CHAT_TOPICS = (
    "the moon landing", "making tea", "linked lists", "the immune system", "budget travel", "earthquakes",
    "chess openings", "version control with git",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, tests and vendored packages left out, in a stable order."""
    root = Path(root or stdlib_root())
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def is_held_out(path: Path, root: Path, held_out_percent: int) -> bool:
    """A fixed tenth (or so) of the modules, chosen by a hash of the path so it never changes between runs."""
    return zlib.crc32(str(path.relative_to(root)).encode()) % 100 < held_out_percent


def held_out_code_files(held_out_percent: int) -> list[Path]:
    """Every held-out module (code_texts keeps only as many as its size limit allows; training reads none)."""
    root = stdlib_root()
    return [path for path in stdlib_files(root) if is_held_out(path, root, held_out_percent)]


def code_texts(max_chars: int, held_out_percent: int, root: Path | None = None) -> tuple[list[str], list[str]]:
    root = Path(root or stdlib_root())
    train, held_out, sizes = [], [], [0, 0]
    held_out_limit = max_chars * held_out_percent // 100
    # In hash order, so a size limit samples modules from the whole library, not those starting with "a".
    for path in sorted(stdlib_files(root), key=lambda p: zlib.crc32(str(p.relative_to(root)).encode(), 1)):
        text = path.read_text(encoding="utf-8", errors="replace")
        goes_to_held_out = is_held_out(path, root, held_out_percent)
        bucket, index, limit = (held_out, 1, held_out_limit) if goes_to_held_out else (train, 0, max_chars)
        if sizes[index] < limit:
            bucket.append(text)
            sizes[index] += len(text)
    return train, held_out


def prose_texts(work_dir: Path, held_out_works: list[str], max_chars: int) -> tuple[list[str], list[str]]:
    train, held_out = split_works(read_works(fetch_texts_dir(work_dir)), held_out_works)
    return _limit(train, max_chars), held_out


def chat_prompts(held_out: bool) -> list[str]:
    if held_out:
        return [template.format(topic=topic) for topic in HELD_OUT_CHAT_TOPICS for template in CHAT_TEMPLATES]
    earlier = [template.format(topic=topic) for topics in (CHAT_TOPICS, MORE_CHAT_TOPICS)
               for templates in (CHAT_TEMPLATES, MORE_CHAT_TEMPLATES) for topic in topics for template in templates]
    return earlier + [template.format(topic=topic) for topic in LATER_CHAT_TOPICS
                      for template in CHAT_TEMPLATES + MORE_CHAT_TEMPLATES]


def line_prompts(texts: list[str], count: int, max_tokens: int, tokenizer, seed: int,
                 ends: re.Pattern | None = None, distinct: bool = False,
                 avoid: list[list[int]] = ()) -> list[list[int]]:
    """`count` prompts of at most max_tokens tokens (at least half that), each ending at a line end of one of the
    texts (or, with `ends`, at the end of the pattern's next match), at places drawn uniformly over all their
    characters; with `distinct`, a prompt already drawn, or one in `avoid`, is passed over (a `def` line after a long
    stretch of text is otherwise drawn often). The first n of a larger count are the same n."""
    rng = random.Random(seed)
    starts = list(itertools.accumulate((len(text) for text in texts), initial=0))
    total = starts.pop()
    prompts, seen, tries = [], set(map(tuple, avoid)), 0
    while len(prompts) < count:
        tries += 1
        if tries > 20 * count + 100:
            raise ValueError(f"found only {len(prompts)} of {count} prompts of {max_tokens // 2}+ tokens in the texts")
        offset = rng.randrange(total)
        index = bisect.bisect_right(starts, offset) - 1
        text = texts[index]
        if ends is None:
            end = text.find("\n", offset - starts[index]) + 1
        else:
            match = ends.search(text, offset - starts[index])
            end = match.end() if match else 0
        if end == 0:
            continue
        ids = tokenizer.encode(text[max(0, end - 8 * max_tokens):end], add_special_tokens=False)[-max_tokens:]
        if len(ids) >= max_tokens // 2 and not (distinct and tuple(ids) in seen):
            prompts.append(ids)
            seen.add(tuple(ids))
    return prompts


def _limit(texts: list[str], max_chars: int) -> list[str]:
    """An equal share of max_chars from the middle of each text."""
    share = max_chars // max(1, len(texts))
    return [text[max(0, len(text) // 2 - share // 2):][:share] for text in texts]
